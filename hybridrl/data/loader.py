"""A resumable, seeded batch sampler and the prompt loader built on it.

The order of epoch ``e`` is a pure function of ``(seed, e)``: ``numpy.random.default_rng([seed, e])
.permutation(n)`` (or ``range(n)`` without shuffling). The state is just ``(epoch, batches taken
in that epoch)``, updated BEFORE each batch is handed out, so ``state_dict()`` taken after
consuming k batches resumes at batch k + 1, and after the last batch of an epoch it points at
the start of the next one. Resuming therefore reproduces exactly the batches an uninterrupted run
would have produced.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from hybridrl.protocol import DataProto


class ResumableBatchSampler:
    """Yields lists of dataset indices, ``batch_size`` at a time, for the rest of the current epoch."""

    def __init__(
        self, num_samples: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"need num_samples >= 1 and batch_size >= 1, got {num_samples}, {batch_size}")
        if drop_last and batch_size > num_samples:
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({num_samples} rows) with drop_last=True: "
                "no batch could ever be formed"
            )
        self.num_samples, self.batch_size, self.shuffle = num_samples, batch_size, shuffle
        self.seed, self.drop_last = seed, drop_last
        self.epoch, self.batch_in_epoch = 0, 0

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch`` (n,)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def peek(self) -> list[int]:
        """The indices the next batch will have, without taking it (the state is unchanged)."""
        start = self.batch_in_epoch * self.batch_size
        return self.epoch_order(self.epoch)[start : start + self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.epoch_order(self.epoch)
        while self.batch_in_epoch < len(self):
            start = self.batch_in_epoch * self.batch_size
            batch = order[start : start + self.batch_size].tolist()
            self.batch_in_epoch += 1
            if self.batch_in_epoch == len(self):  # last batch: the state already points at the next epoch
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                yield batch
                return
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; the data size, batch size and seed must match the saved ones."""
        for key in ("seed", "num_samples", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the sampler: saved {key}={state[key]} but this run has {getattr(self, key)}"
                )
        if not 0 <= state["batch_in_epoch"] < len(self):
            raise ValueError(f"sampler state batch_in_epoch={state['batch_in_epoch']} is outside [0, {len(self)})")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])


class PromptDataLoader:
    """Iterates DataProto batches (``dataset.collate``) for the rest of the current epoch, in this
    process (no prefetching workers, so the saved state is exactly what was consumed).

    ``prefetch()`` makes the next batch ahead of time (the trainer calls it while the workers run
    an update) without taking it: the state still names that batch as the next, and iterating
    hands out the batch made ahead when it gets there (or makes it then, if the state moved).
    """

    def __init__(
        self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        self.dataset = dataset
        self.sampler = ResumableBatchSampler(len(dataset), batch_size, shuffle, seed, drop_last)
        self._ahead: tuple[tuple[int, int], DataProto] | None = None  # ((epoch, batch), batch) made by prefetch

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[DataProto]:
        batches = iter(self.sampler)
        while True:
            position = self._position()
            indices = next(batches, None)
            if indices is None:
                return
            ahead, self._ahead = self._ahead, None
            yield ahead[1] if ahead is not None and ahead[0] == position else self._make(indices)

    def prefetch(self) -> None:
        """Make the next batch now; the sampler's state does not move (class docstring)."""
        position = self._position()
        if self._ahead is None or self._ahead[0] != position:
            self._ahead = (position, self._make(self.sampler.peek()))

    def _position(self) -> tuple[int, int]:
        return self.sampler.epoch, self.sampler.batch_in_epoch

    def _make(self, indices: list[int]) -> DataProto:
        return self.dataset.collate(self.dataset.__getitems__(indices))

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

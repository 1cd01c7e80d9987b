"""The rollout interface: `SamplingParams` and the `RolloutEngine` protocol.

Every rollout backend (the native KV-cache engine here, a vLLM adapter later) takes a left-padded
prompt batch and returns the verl rollout batch, so workers never know which backend runs.

Shape letters: N prompts, G = `n` samples per prompt, B = N*G rows, P prompt length,
R = `max_new_tokens` response length, T = P + R, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # DataProto is only named in signatures here
    from hybridrl.protocol import DataProto


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses (names follow vLLM / verl's rollout config).

    Log-prob convention (verl): `rollout_log_probs` is log_softmax(logits / temperature) over the
    FULL vocabulary, taken at the sampled token, before top-k / top-p filtering, because that is what
    the trainer recomputes. With temperature 0 (greedy) the logits are not scaled (temperature 1).
    """

    n: int = 1
    """Samples per prompt (G); sample g of prompt i is output row i*n + g."""
    temperature: float = 1.0
    """Logits are divided by this before sampling; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 or 0 disables."""
    max_new_tokens: int = 64
    """Response length R: generation stops here and `responses` is always padded to exactly R."""
    do_sample: bool = True
    """False: greedy decoding (argmax), as verl's validation `val_kwargs.do_sample=False`."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end a response; like EOS they are kept in the response and its mask."""
    eos_token_id: int | tuple[int, ...] | None = None
    """End-of-sequence id(s); None: no EOS stop (generate exactly max_new_tokens)."""
    pad_token_id: int = 0
    """Fills `responses` after the end of each response."""
    seed: int | None = None
    """Sampling seed. Row b draws from its own generator seeded by (seed, b), so its tokens do not
    depend on which other rows are in the batch or when they finish. None: drawn from torch's RNG."""
    logprobs: bool = True
    """Compute `rollout_log_probs`; False leaves them as zeros (saves one log_softmax per step)."""
    extra: dict = field(default_factory=dict, compare=False)
    """Backend-specific options (ignored by the native engine)."""

    def __post_init__(self) -> None:
        checks = {
            "n": (self.n >= 1, ">= 1"),
            "temperature": (self.temperature >= 0, ">= 0"),
            "top_p": (0 < self.top_p <= 1, "in (0, 1]"),
            "top_k": (self.top_k == -1 or self.top_k >= 0, "-1, 0 (disabled) or a positive int"),
            "max_new_tokens": (self.max_new_tokens >= 1, ">= 1"),
        }
        for key, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"SamplingParams.{key}={getattr(self, key)!r} is invalid: must be {allowed}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (do_sample=False or temperature 0)."""
        return not self.do_sample or self.temperature == 0

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """All token ids that end a response: EOS id(s) then `stop_token_ids`."""
        eos = self.eos_token_id
        eos_ids: Sequence[int] = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        return tuple(dict.fromkeys([*eos_ids, *self.stop_token_ids]))

    def with_updates(self, **changes) -> SamplingParams:
        """A copy with some fields changed (e.g. `val_kwargs` over the training params)."""
        return replace(self, **changes)


@runtime_checkable
class RolloutEngine(Protocol):
    """What a rollout backend provides to the rollout worker.

    `generate` input: `input_ids, attention_mask, position_ids (N,P)` left-padded, plus any
    non-tensor columns. Output (B = N*n rows, row i*n+g = sample g of prompt i; non-tensor columns
    repeated the same way): `prompts (B,P)`, `responses (B,R)` right-padded with pad_token_id,
    `input_ids (B,T)`, `attention_mask (B,T)` (1 on real prompt tokens and on response tokens up to
    and including the stop token), `position_ids (B,T)` = clamp(cumsum(attention_mask) - 1, 0),
    `response_mask (B,R)`, `rollout_log_probs (B,R)` float32 (0 where masked).
    """

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """Sample `params.n` responses for every prompt row."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights from the trainer (HF state-dict names); later generations use them."""
        ...

    def free_cache(self) -> None:
        """Release the KV cache memory (between rollout and training phases)."""
        ...


def eos_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """End-of-response ids: the tokenizer's eos plus the model's ``generation_config`` eos (which
    chat models often set to the end-of-turn token, e.g. ``<|im_end|>``)."""
    ids = [tokenizer.eos_token_id]
    gen_eos = getattr(generation_config, "eos_token_id", None)
    ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

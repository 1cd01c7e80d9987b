"""Small role classes the worker-group tests run on Ray ranks and in-process.

They do real work (torch ops, a gloo all_reduce, os._exit) so the tests exercise the real
rendezvous, dispatch and failure paths.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.engine.distributed import init_distributed
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Worker, register


class ToyActor(Worker):
    """Scales rows; reports where it runs; fails on request."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def not_registered(self) -> int:
        return 1

    @register(Dispatch.ONE_TO_ALL)
    def info(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        return {"pid": os.getpid(), **{k: os.environ[k] for k in keys}}

    @register(Dispatch.ONE_TO_ALL)
    def set_scale(self, scale: float) -> None:
        self.scale = scale

    @register(Dispatch.DP_COMPUTE_PROTO)
    def scale_rows(self, data: DataProto, offset: float = 0.0) -> DataProto:
        """y (B,) = x * scale + offset; ``rank`` and ``rows_seen`` say who computed each row."""
        n = len(data)
        return DataProto.from_dict(
            tensors={"y": data.batch["x"] * self.scale + offset, "rank": torch.full((n,), self.rank),
                     "rows_seen": torch.full((n,), n)},
            non_tensors={"uid": data.non_tensor_batch["uid"]},
            meta_info={"rank": self.rank},
        )

    @register(Dispatch.DP_COMPUTE_PROTO)
    def add_y(self, data: DataProto) -> DataProto:
        """z = x + y, y joined from an earlier scale_rows on this rank; and who saw how many rows."""
        n = len(data)
        return DataProto.from_dict({"z": data.batch["x"] + data.batch["y"], "joined_rank": data.batch["rank"],
                                    "rank": torch.full((n,), self.rank)})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def fail_rows(self, data: DataProto) -> DataProto:
        raise ValueError(f"bad rows on rank {self.rank}")

    @register(Dispatch.DP_COMPUTE_PROTO)
    def sample_twice(self, data: DataProto) -> DataProto:
        """Two samples per input row (interleaved), like rollout.n=2."""
        out = data.repeat(2, interleave=True)
        out.batch["sample"] = torch.arange(len(out)) % 2
        return out

    @register(Dispatch.DP_COMPUTE_PROTO)
    def drop_one_row(self, data: DataProto) -> DataProto:
        return data[1:]

    @register(Dispatch.DP_COMPUTE_PROTO)
    def row_count(self, data: DataProto) -> int:
        return len(data)

    @register(Dispatch.RANK_ZERO)
    def whoami(self) -> int:
        return self.rank

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def slow_rank(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def sleep_by_rank(self, seconds: float) -> int:
        """Rank r works (sleeps) ``seconds * (r + 1)``."""
        time.sleep(seconds * (self.rank + 1))
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        """sum over ranks of (rank + 1) through a real gloo all_reduce."""
        init_distributed()
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        return float(t.item())

    @register(Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, bad_rank: int) -> int:
        if self.rank == bad_rank:
            raise ValueError(f"bad batch on rank {bad_rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def exit_during_collective(self, bad_rank: int) -> float:
        """``bad_rank`` exits while the others wait for it inside an all_reduce (forever, on gloo)."""
        init_distributed()
        if self.rank == bad_rank:
            time.sleep(0.5)
            os._exit(3)
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t.item())

    @register(Dispatch.ONE_TO_ALL)
    def peer_error_before_death(self, bad_rank: int) -> int:
        """The race of ``exit_during_collective`` in its worst order, every time: the other ranks
        fail at once (as gloo's "connection closed by peer" does), ``bad_rank`` dies a second later."""
        if self.rank == bad_rank:
            time.sleep(1.0)
            os._exit(3)
        raise RuntimeError(f"rank {self.rank}: connection closed by peer rank {bad_rank}")


class ToyRef(Worker):
    """Colocated with ToyActor: holds the actor object itself (composition in one process)."""

    def __init__(self, actor: ToyActor) -> None:
        self.actor = actor

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def actor_scale(self) -> float:
        return self.actor.scale


class LinearWorker(Worker):
    """A seeded nn.Linear that scores rows and takes SGD steps (for local-vs-Ray parity)."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.1)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def score(self, data: DataProto) -> DataProto:
        """scores (B, 3) = Linear(x (B, 4))."""
        with torch.no_grad():
            return DataProto.from_dict(tensors={"scores": self.model(data.batch["x"])})

    @register(Dispatch.ONE_TO_ALL)
    def train_step(self, data: DataProto) -> float:
        loss = self.model(data.batch["x"]).pow(2).mean()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        return float(loss.item())

    @register(Dispatch.ONE_TO_ALL)
    def mutate_input(self, data: DataProto) -> None:
        data.batch["x"].zero_()


def make_rows(n: int, dim: int = 0) -> DataProto:
    """n rows: x = arange (B,) or (B, dim) floats, uid = 'u<i>'."""
    x = torch.arange(float(n)) if dim == 0 else torch.arange(float(n * dim)).reshape(n, dim) / 10
    uid = np.array([f"u{i}" for i in range(n)], dtype=object)
    return DataProto.from_dict(tensors={"x": x}, non_tensors={"uid": uid})

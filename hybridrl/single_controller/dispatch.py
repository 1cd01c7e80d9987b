"""Split a call's arguments over ranks and merge the per-rank results (backend-agnostic, pure).

``plan_call`` turns ``(mode, world_size, args, kwargs)`` into a :class:`CallPlan` (which ranks run,
with which arguments); ``collect_results`` merges what those ranks returned. Both backends (Ray and
local) use these two functions, which is why a local run gives the same results as a 1-rank Ray run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.protocol import DataProto
from hybridrl.single_controller.decorator import Dispatch

__all__ = ["CallPlan", "collect_results", "plan_call"]


@dataclass(frozen=True)
class CallPlan:
    """Which ranks run and what each receives.

    ``calls[i]`` is the ``(args, kwargs)`` of rank ``ranks[i]``. For DP_COMPUTE_PROTO,
    ``rows`` is the padded row count B' (a multiple of the world size) and ``pad_size`` the
    number of padding rows appended to the B input rows (B' = B + pad_size).
    """

    mode: Dispatch
    ranks: tuple[int, ...]
    calls: tuple[tuple[tuple, dict], ...]
    rows: int = 0
    pad_size: int = 0


def plan_call(mode: Dispatch, world_size: int, args: tuple, kwargs: dict) -> CallPlan:
    """The per-rank arguments of one call (see :class:`Dispatch` for the rules)."""
    if mode is Dispatch.ONE_TO_ALL:
        return CallPlan(mode, tuple(range(world_size)), tuple((args, kwargs) for _ in range(world_size)))
    if mode is Dispatch.RANK_ZERO:
        return CallPlan(mode, (0,), ((args, kwargs),))
    if mode is Dispatch.DP_COMPUTE_PROTO:
        return _plan_dp(world_size, args, kwargs)
    raise ValueError(f"unknown dispatch mode {mode!r}; allowed: {[m.name for m in Dispatch]}")


def _plan_dp(world_size: int, args: tuple, kwargs: dict) -> CallPlan:
    positions = [i for i, a in enumerate(args) if isinstance(a, DataProto)]
    names = [k for k, v in kwargs.items() if isinstance(v, DataProto)]
    if not positions and not names:
        raise TypeError("Dispatch.DP_COMPUTE_PROTO needs at least one DataProto argument; got none")
    lengths = {f"arg {i}": len(args[i]) for i in positions} | {k: len(kwargs[k]) for k in names}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"DP_COMPUTE_PROTO: DataProto arguments differ in row count: {lengths}")
    if next(iter(lengths.values())) == 0:
        raise ValueError(f"DP_COMPUTE_PROTO: cannot split an empty DataProto over {world_size} ranks")

    def shard(data: DataProto) -> list[DataProto]:
        padded, _ = data.pad_to_divisor(world_size)
        return padded.chunk(world_size)

    arg_shards = {i: shard(args[i]) for i in positions}
    kw_shards = {k: shard(kwargs[k]) for k in names}
    calls = []
    for r in range(world_size):
        rank_args = tuple(arg_shards[i][r] if i in arg_shards else a for i, a in enumerate(args))
        rank_kwargs = {k: kw_shards[k][r] if k in kw_shards else v for k, v in kwargs.items()}
        calls.append((rank_args, rank_kwargs))
    rows = next(iter(lengths.values()))
    pad = (-rows) % world_size
    return CallPlan(Dispatch.DP_COMPUTE_PROTO, tuple(range(world_size)), tuple(calls), rows + pad, pad)


def collect_results(plan: CallPlan, results: list[Any]) -> Any:
    """Merge the per-rank ``results`` (in ``plan.ranks`` order) as ``plan.mode`` says."""
    if plan.mode is Dispatch.RANK_ZERO:
        return results[0]
    if plan.mode is Dispatch.DP_COMPUTE_PROTO and results and all(isinstance(r, DataProto) for r in results):
        return _concat_unpad(plan, results)
    return list(results)


def _concat_unpad(plan: CallPlan, results: list[DataProto]) -> DataProto:
    merged = DataProto.concat(results)
    if plan.pad_size == 0:
        return merged
    # Padding rows sit at the end of the last rank's shard, so they are the trailing rows of the
    # merged output as long as every rank returns the same number k of rows per input row.
    per_rank_in = plan.rows // len(plan.ranks)
    sizes = [len(r) for r in results]
    if len(merged) % plan.rows or any(s * len(plan.ranks) != len(merged) for s in sizes):
        raise ValueError(
            f"DP_COMPUTE_PROTO: cannot remove {plan.pad_size} padding row(s): ranks got {per_rank_in} rows "
            f"each but returned {sizes} rows; each rank must return k rows per input row (same k)"
        )
    return merged.unpad(plan.pad_size * (len(merged) // plan.rows))

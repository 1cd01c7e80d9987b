"""``@register``: how the driver calls a worker method (dispatch mode) and whether it waits.

A worker is a plain Python class. Decorating a method with ``@register(...)`` only attaches a
small :class:`MethodSpec` to the function; the worker group reads it on the driver to decide how
to split the arguments over the ranks and how to merge the per-rank results. Undecorated methods
are private to the worker process: the driver cannot call them, which keeps the remote surface of
each role explicit (as in verl).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Dispatch", "MethodSpec", "register", "registered_methods"]

_ATTR = "__hybridrl_dispatch__"
F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(enum.Enum):
    """How a call is spread over the ranks of a worker group and how results come back.

    - ``ONE_TO_ALL``: every rank gets the same arguments; the result is the list of the
      per-rank results, in rank order (length = world size).
    - ``DP_COMPUTE_PROTO``: each ``DataProto`` argument (B rows) is padded to a multiple of the
      world size W with copies of its first rows, then chunked: rank r gets rows
      ``[r*B'/W, (r+1)*B'/W)`` of the padded B'. Other arguments go to every rank unchanged. If
      every rank returns a DataProto, they are concatenated in rank order and the padding rows
      are removed (a rank may return k rows per input row, e.g. G samples per prompt; the
      ``k * pad`` trailing rows are dropped); ``meta_info`` comes from rank 0. Any other return
      type gives the per-rank list, as ONE_TO_ALL.
    - ``RANK_ZERO``: only rank 0 runs the method; the result is rank 0's result. The method
      must not enter a collective (the other ranks are not running it).
    """

    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` recorded for one method."""

    dispatch_mode: Dispatch
    blocking: bool


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL, blocking: bool = True) -> Callable[[F], F]:
    """Expose a worker method to the driver.

    Args:
        dispatch_mode: a :class:`Dispatch` member (see there for the split/merge rules).
        blocking: True waits for all ranks and returns the merged result; False returns a
            :class:`~hybridrl.single_controller.worker_group.WorkerFuture` whose ``get()`` does.
    """
    if not isinstance(dispatch_mode, Dispatch):
        allowed = ", ".join(f"Dispatch.{m.name}" for m in Dispatch)
        raise TypeError(f"register(dispatch_mode=...) got {dispatch_mode!r}; allowed: {allowed}")
    spec = MethodSpec(dispatch_mode=dispatch_mode, blocking=bool(blocking))

    def mark(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"@register must decorate a method, got {fn!r}")
        setattr(fn, _ATTR, spec)
        return fn

    return mark


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Name -> MethodSpec for every ``@register``-ed method of ``cls`` (inherited ones included)."""
    out: dict[str, MethodSpec] = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), _ATTR, None)
        if isinstance(spec, MethodSpec):
            out[name] = spec
    return out

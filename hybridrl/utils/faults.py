"""Fault injection for reliability tests and drills: make one worker fail in one phase on purpose.

``HYBRIDRL_INJECT_FAULT="<phase>[@rank<r>][:<kind>]"`` with kind ``raise`` (default), ``exit``
(the process dies with ``os._exit(1)``, as if killed) or ``nan`` (:func:`maybe_inject` returns
True and the caller poisons its inputs with NaN, to drill ``trainer.nan_policy``). Phases are the
worker methods' names (``generate_sequences``, ``compute_log_prob``, ``update_actor``, ...) and the
driver's ``commit_checkpoint`` (after the workers wrote their shards, before the checkpoint is
published). Unset, it costs one dictionary lookup per call.
"""

from __future__ import annotations

import os

ENV = "HYBRIDRL_INJECT_FAULT"


class InjectedFault(RuntimeError):
    pass


def maybe_inject(phase: str) -> bool:
    """Raise, exit, or return True (kind ``nan``) when the fault spec targets ``phase`` on this rank."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    target, _, kind = spec.partition(":")
    name, _, rank = target.partition("@rank")
    if name != phase or (rank and int(rank) != int(os.environ.get("RANK", "0"))):
        return False
    if kind == "exit":
        os._exit(1)
    if kind == "nan":
        return True
    raise InjectedFault(f"fault injected by {ENV}={spec!r} in {phase} on rank {os.environ.get('RANK', '0')}")

"""Fault injection for reliability tests and drills: make one worker fail in one phase on purpose.

``HYBRIDRL_INJECT_FAULT="<phase>[@rank<r>][:<kind>]"`` with kind ``raise`` (default) or ``exit``
(the process dies with ``os._exit(1)``, as if killed). Phases are the worker methods' names
(``generate_sequences``, ``compute_log_prob``, ``update_actor``, ...). Unset, it costs one
dictionary lookup per call.
"""

from __future__ import annotations

import os

ENV = "HYBRIDRL_INJECT_FAULT"


class InjectedFault(RuntimeError):
    pass


def maybe_inject(phase: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, kind = spec.partition(":")
    name, _, rank = target.partition("@rank")
    if name != phase or (rank and int(rank) != int(os.environ.get("RANK", "0"))):
        return
    if kind == "exit":
        os._exit(1)
    raise InjectedFault(f"fault injected by {ENV}={spec!r} in {phase} on rank {os.environ.get('RANK', '0')}")

"""Tell Python's cyclic garbage collector which objects are permanent, once a run has warmed up.

After its first steps a training process holds hundreds of thousands of long-lived objects: the
model's modules and parameters, ``torch.compile``'s graphs, guards and caches, transformers' config
and tokenizer objects. Every full (generation-2) collection walks all of them again: in a tiny-model
GRPO run (0.45 s steps) one took 343 ms, about once every 45 steps, on top of the young generations'
collections. ``freeze_survivors`` runs one full collection and moves what survives into the
permanent generation (``gc.freeze``), so later collections walk only what was made since.

Frozen objects are still freed by reference counting; a reference cycle among them would never be
collected. That is why the trainer calls this between steps, after warm-up, when the process holds
little besides its long-lived state (``PPOTrainer.fit``, in the driver and in every worker
process), and ``release``s the driver's frozen objects when ``fit`` returns, so that a second run in
the same process (a notebook, a test session) can collect the first one's; worker processes end
with the run. ``HYBRIDRL_GC_FREEZE=0`` turns it off.
"""

from __future__ import annotations

import gc
import os

__all__ = ["WARMUP_STEPS", "enabled", "freeze_survivors", "release"]

WARMUP_STEPS = 2  # freeze after each of a run's first steps (compilation in the first, new shapes in the second)


def enabled() -> bool:
    return os.environ.get("HYBRIDRL_GC_FREEZE", "1").strip().lower() not in ("0", "false", "off", "no")


_froze = False  # whether this process froze objects here (release leaves anyone else's alone)


def freeze_survivors() -> int:
    """One full collection, then freeze what survived (unless turned off); returns how many objects
    the permanent generation holds afterwards (0 when off)."""
    global _froze
    if not enabled():
        return 0
    gc.collect()
    gc.freeze()
    _froze = True
    return gc.get_freeze_count()


def release() -> None:
    """Return the objects frozen by ``freeze_survivors`` to the collector (``gc.unfreeze``); nothing
    when it froze none."""
    global _froze
    if _froze:
        gc.unfreeze()
        _froze = False

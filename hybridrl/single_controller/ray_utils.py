"""Starting (or joining) Ray the way hybridrl needs it: quiet, no dashboard, no token auth."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["init_ray"]

# Environment a worker needs to behave like the driver (offline hubs, quiet tokenizers). A local
# cluster inherits the driver's environment anyway; runtime_env carries these to remote nodes.
_FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS",
                  "HYBRIDRL_NUM_THREADS", "HF_HOME", "PYTHONHASHSEED")

# Largest task argument or result sent inline (Ray's default: 100 KiB); see init_ray.
INLINE_OBJECT_BYTES = 4 * 1024 * 1024


def init_ray(
    num_cpus: int | None = None, address: str | None = None, extra_sys_path: Sequence[str] = (), **kwargs: Any
) -> None:
    """Start a local Ray (or connect to ``address``) unless this process already did; idempotent.

    Args:
        num_cpus: CPUs Ray may schedule on a new local cluster (None: all of them). Ignored
            when connecting to an existing cluster.
        address: ``None`` starts a fresh local cluster; ``"auto"`` or ``"host:port"`` joins one.
        extra_sys_path: directories the workers must import from besides the installed packages,
            the driver's current directory and its script's directory (which Ray adds itself),
            e.g. a folder of test helpers or reward functions; prepended to their PYTHONPATH.
        kwargs: passed to ``ray.init`` (they override the defaults below).

    Role classes travel to the workers by reference (module + name), so their module must be
    importable there: an installed package, the driver's directory, or ``extra_sys_path``.
    """
    # Read by Ray when it starts: without it Ray 2.5x warns about token authentication.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray starts workers at nice 15 by default. hybridrl's workers are where the training and the
    # rollout run, so on a machine shared with anything else (the driver's reward processes, an
    # editor, a second job) they would get the leftovers: start them at normal priority instead.
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray

    if ray.is_initialized():
        return
    env_vars = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    if extra_sys_path:
        paths = [os.path.abspath(p) for p in extra_sys_path] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        env_vars["PYTHONPATH"] = os.pathsep.join(paths)
    options: dict[str, Any] = {
        "address": address,
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": True,
        "runtime_env": {"env_vars": env_vars},
    }
    if address is None:
        options["num_cpus"] = num_cpus
        # Arguments and results up to this size travel inside the task messages instead of through
        # the shared-memory object store, whose put/get/release round trips took about 1.5 ms of each
        # call's dispatch at the quickstart's size (a rank's share of a batch is a few hundred KB).
        options["_system_config"] = {"max_direct_call_object_size": INLINE_OBJECT_BYTES}
    options.update(kwargs)
    ray.init(**options)

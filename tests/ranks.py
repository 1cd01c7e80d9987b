"""Launching a script as the ranks of a local gloo group, for the multi-process tests (test_distributed,
test_replicas, test_model_merger): each rank a subprocess with RANK / WORLD_SIZE / MASTER_* set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from hybridrl.engine.distributed import free_port

# A rank's whole run, generous: on a 2-core Zen 1 with an empty inductor cache (a clean CI machine),
# dist_worker.py's compiled blocks alone take about 270 s to build (both ranks compile at once, and
# every block compiles for batch size 1 and 2+, with and without grad). A collective that hangs fails
# much sooner: the ranks' process group times out after 120 s (helpers.rank_main).
RANK_TIMEOUT_S = 600


def launch_ranks(argv: list[str], log_dir: Path, world: int = 2, **env_extra: str) -> None:
    """Run ``python *argv`` as ranks 0 .. world - 1, logging to ``log_dir/rank<r>.log``. A rank that
    fails or runs past ``RANK_TIMEOUT_S`` fails the caller with the end of its log."""
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **env_extra)
    procs = []
    for rank in range(world):
        log = open(log_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, *map(str, argv)], env=dict(env, RANK=str(rank)),
                                       stdout=log, stderr=subprocess.STDOUT), log))
    for proc, log in procs:
        try:
            proc.wait(timeout=RANK_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (log_dir / f"rank{rank}.log").read_text()[-4000:]


def run_ranks(script: Path, out: Path, world: int = 2, **env_extra: str) -> list[dict]:
    """``launch_ranks`` of ``script out``; returns what each rank saved to ``out/rank<r>.pt``."""
    launch_ranks([script, out], out, world, **env_extra)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]

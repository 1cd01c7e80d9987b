"""A worker rank that dies mid-step (Ray backend, 2 ranks) stops the run with a message naming the
worker, rank and phase, and leaves no process behind (workers, Ray daemons, reward workers)."""

from __future__ import annotations

import time
import uuid

import pytest
from reliability_helpers import main_ppo_process, make_assets, processes_with_env, small_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]  # a fresh Ray cluster in a child process


def test_killed_worker_stops_the_run_and_leaves_no_process(tmp_path):
    assets = make_assets(tmp_path / "assets")
    marker = f"HYBRIDRL_RELIABILITY_RUN={uuid.uuid4().hex}"
    overrides = small_overrides(assets, tmp_path / "run", **{"trainer.val_before_train": False,
                                                             "reward.num_workers": 1})
    key, value = marker.split("=")
    proc = main_ppo_process(overrides, {"HYBRIDRL_INJECT_FAULT": "update_actor@rank1:exit", key: value})
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "WorkerDiedError" in err and "died (process exited or was killed)" in err, err[-3000:]
    assert "rank 1 of 2" in err and "update_actor()" in err and "ActorWorker" in err
    deadline = time.monotonic() + 60  # Ray's daemons exit asynchronously after the driver
    while processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with_env(marker) == [], "processes of the failed run are still alive"

"""A run killed after a checkpoint resumes exactly; a failing worker stops the run with its traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_helpers import comparable, config, make_assets, read_metrics, small_overrides

from hybridrl.trainer.checkpoint import TRACKER_FILE
from hybridrl.trainer.main_ppo import run

pytestmark = [pytest.mark.e2e]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("resume_assets"))


def _main_ppo(overrides: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", **(env_extra or {})}
    cmd = [sys.executable, "-m", "hybridrl.trainer.main_ppo", "--preset", "grpo_quickstart", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_killed_run_resumes_with_identical_metrics(assets, tmp_path):
    # 16 train rows per epoch / 4 prompts per step = 4 steps an epoch: 6 steps cross an epoch boundary
    extra = {"trainer.backend": "local", "trainer.n_cpu_workers": 1, "trainer.total_training_steps": 6,
             "trainer.save_freq": 3, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
             "actor_rollout_ref.actor.optim.lr_warmup_steps": 1}
    small_assets = dict(assets)
    small_assets["train"] = _head(assets["train"], tmp_path / "train16.parquet", 16)
    run(config(small_assets, tmp_path / "straight", **extra))
    straight = read_metrics(tmp_path / "straight")

    killed_dir = tmp_path / "killed"
    proc = _main_ppo(small_overrides(small_assets, killed_dir, **extra))
    tracker = killed_dir / TRACKER_FILE
    deadline = time.monotonic() + 600
    while not (tracker.exists() and tracker.read_text() == "3"):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 600 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    run(config(small_assets, killed_dir, **extra))  # resume_mode=auto picks global_step_3
    resumed = read_metrics(killed_dir)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        a, b = comparable(straight[step]), comparable(resumed[step])
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (step, key)
    assert straight[6]["training/epoch"] == 1.0


def _head(src: str, dst: Path, rows: int) -> str:
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(src).slice(0, rows), dst)
    return str(dst)


def test_worker_that_raises_stops_the_run_with_its_traceback(assets, tmp_path):
    overrides = small_overrides(assets, tmp_path / "fault", **{"trainer.val_before_train": False})
    proc = _main_ppo(overrides, {"HYBRIDRL_INJECT_FAULT": "update_actor@rank1"})
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "InjectedFault" in err and "Traceback" in err
    assert "rank 1 of 2" in err and "update_actor" in err

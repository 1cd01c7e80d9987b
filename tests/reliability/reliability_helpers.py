"""Shared set-up for the reliability tests: the trainer's tiny assets plus subprocess/process helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

from e2e_helpers import comparable, config, make_assets, read_metrics, small_overrides  # noqa: E402

__all__ = ["LOCAL", "all_records", "comparable", "config", "main_ppo_process", "make_assets", "processes_with_env",
           "read_metrics", "small_overrides"]

REPO = Path(__file__).resolve().parents[2]
# One in-process rank, no validation: the cheapest real run of the whole fit loop.
LOCAL = {"trainer.backend": "local", "trainer.n_cpu_workers": 1, "trainer.test_freq": -1,
         "trainer.val_before_train": False}


def main_ppo_process(overrides: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m hybridrl.trainer.main_ppo --preset grpo_quickstart <overrides>`` as a child process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", **(env_extra or {})}
    cmd = [sys.executable, "-m", "hybridrl.trainer.main_ppo", "--preset", "grpo_quickstart", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def all_records(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl in order (a resumed run logs some steps twice)."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def processes_with_env(marker: str) -> list[int]:
    """Pids whose environment contains ``marker`` (inherited by every process a run starts)."""
    needle = marker.encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return found

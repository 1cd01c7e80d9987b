"""A driver killed while writing a checkpoint resumes from the previous complete one with the same
metrics; a truncated checkpoint file is named at resume, with the previous checkpoint offered."""

from __future__ import annotations

from pathlib import Path

import pytest
from reliability_helpers import (
    LOCAL,
    all_records,
    comparable,
    config,
    main_ppo_process,
    make_assets,
    small_overrides,
)

from hybridrl.trainer.checkpoint import COMPLETE_MARKER, TRACKER_FILE, CheckpointError
from hybridrl.trainer.main_ppo import run

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("ckpt_fault_assets"))


def _by_step(records: list[dict], step: int) -> list[dict]:
    return [comparable({k: v for k, v in r.items() if k != "step"}) for r in records if r["step"] == step]


@pytest.mark.slow  # four runs, one in a child process
def test_kill_during_checkpoint_write_then_truncated_shard(assets, tmp_path):
    run_dir = tmp_path / "run"
    extra = {**LOCAL, "trainer.save_freq": 2}
    run(config(assets, run_dir, **extra))  # steps 1-2, checkpoint global_step_2
    assert (run_dir / TRACKER_FILE).read_text() == "2"

    # steps 3-4 in a child process that dies (os._exit) after the shards of step 4 are written
    proc = main_ppo_process(small_overrides(assets, run_dir, **extra, **{"trainer.total_training_steps": 4}),
                            {"HYBRIDRL_INJECT_FAULT": "commit_checkpoint:exit"})
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-3000:]
    staged = run_dir / "global_step_4.tmp"
    assert (staged / "actor").is_dir() and not (staged / COMPLETE_MARKER).exists()
    assert not (run_dir / "global_step_4").exists() and (run_dir / TRACKER_FILE).read_text() == "2"

    # resume_mode=auto takes global_step_2 and repeats steps 3-4 exactly
    run(config(assets, run_dir, **extra, **{"trainer.total_training_steps": 4}))
    records = all_records(run_dir)
    for step in (3, 4):
        killed, resumed = _by_step(records, step)
        assert killed.keys() == resumed.keys()
        for key in killed:
            assert killed[key] == pytest.approx(resumed[key], rel=1e-6, abs=1e-7), (step, key)
    assert (run_dir / TRACKER_FILE).read_text() == "4" and not staged.exists()

    # a shard truncated after the fact is named before anything is loaded; step 2 is offered
    shard = next(iter(sorted((run_dir / "global_step_4" / "actor").rglob("*.distcp"))))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError) as info:
        run(config(assets, run_dir, **extra, **{"trainer.total_training_steps": 6}))
    message = str(info.value)
    assert str(shard) in message and "bytes" in message
    assert f"trainer.resume_from_path={run_dir / 'global_step_2'}" in message


def test_rotation_keeps_the_newest(tmp_path):
    from hybridrl.trainer.checkpoint import (
        commit_checkpoint,
        list_checkpoints,
        staging_dir,
        verify_checkpoint,
    )

    for step in (1, 2, 3):
        (staging_dir(tmp_path, step) / "state.bin").write_bytes(b"x" * step)
        commit_checkpoint(tmp_path, step, max_to_keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["global_step_2", "global_step_3"]
    verify_checkpoint(tmp_path / "global_step_3", tmp_path)
    (tmp_path / "global_step_3" / "state.bin").unlink()
    with pytest.raises(CheckpointError, match=r"state.bin is missing.*global_step_2"):
        verify_checkpoint(tmp_path / "global_step_3", Path(tmp_path))

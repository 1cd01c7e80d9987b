import pytest

from hybridrl.trainer import checkpoint as ckpt


def save(root, step, keep=None):
    stage = ckpt.staging_dir(root, step)
    (stage / "actor").mkdir()
    (stage / "actor" / "rank0.pt").write_text("w")
    return ckpt.commit_checkpoint(root, step, keep)


def test_commit_writes_tracker_and_rotates(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["global_step_2", "global_step_3"]
    assert (tmp_path / ckpt.TRACKER_FILE).read_text() == "3"
    assert ckpt.find_resume_checkpoint(tmp_path, "auto", None).name == "global_step_3"
    assert ckpt.find_resume_checkpoint(tmp_path, "disable", None) is None


def test_half_written_checkpoint_is_never_picked(tmp_path):
    save(tmp_path, 1)
    stage = ckpt.staging_dir(tmp_path, 2)  # killed before commit
    (stage / "actor").mkdir()
    assert ckpt.find_resume_checkpoint(tmp_path, "auto", None).name == "global_step_1"
    save(tmp_path, 2)  # a later save of the same step replaces the leftover staging dir
    assert ckpt.find_resume_checkpoint(tmp_path, "auto", None).name == "global_step_2"


def test_missing_tracked_checkpoint_offers_previous(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "global_step_2" / ckpt.COMPLETE_MARKER).unlink()
    with pytest.raises(ckpt.CheckpointError, match="global_step_1"):
        ckpt.find_resume_checkpoint(tmp_path, "auto", None)


def test_resume_path_requires_complete_dir(tmp_path):
    path = save(tmp_path, 4)
    assert ckpt.find_resume_checkpoint(tmp_path, "resume_path", str(path)) == path
    with pytest.raises(ckpt.CheckpointError, match="resume_from_path"):
        ckpt.find_resume_checkpoint(tmp_path, "resume_path", None)
    with pytest.raises(ckpt.CheckpointError, match="valid"):
        ckpt.find_resume_checkpoint(tmp_path, "sometimes", None)

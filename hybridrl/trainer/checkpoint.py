"""Checkpoint directories on the driver side, in verl's layout.

    <default_local_dir>/
        latest_checkpointed_iteration.txt      "<N>"
        global_step_<N>/
            actor/   critic/                   written by the workers (one shard file per rank)
            trainer_state.pt                   step, data-loader position, controller state
            COMPLETE                           written last

A checkpoint is written into ``global_step_<N>.tmp`` and renamed only when every part is on disk,
then the tracker file is replaced atomically, so a run killed while saving never leaves a
half-written checkpoint that resume would pick up.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    pass


def staging_dir(root: str | os.PathLike, step: int) -> Path:
    """Where the parts of step ``step`` are written before commit_checkpoint publishes them."""
    path = Path(root) / f"global_step_{step}.tmp"
    if path.exists():
        shutil.rmtree(path)  # left by a run killed mid-save: never complete, safe to drop
    path.mkdir(parents=True)
    return path


def commit_checkpoint(root: str | os.PathLike, step: int, max_to_keep: int | None = None) -> Path:
    """Publish a staged checkpoint: mark complete, rename into place, update the tracker, rotate."""
    root = Path(root)
    staged = root / f"global_step_{step}.tmp"
    (staged / COMPLETE_MARKER).write_text(str(step))
    final = root / f"global_step_{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    tmp_tracker = root / (TRACKER_FILE + ".tmp")
    tmp_tracker.write_text(str(step))
    os.replace(tmp_tracker, root / TRACKER_FILE)
    if max_to_keep is not None and max_to_keep > 0:
        for old in list_checkpoints(root)[:-max_to_keep]:
            shutil.rmtree(old)
    return final


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / COMPLETE_MARKER).exists():
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def step_of(path: str | os.PathLike) -> int:
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path}: a checkpoint folder is named global_step_<N>")
    return int(m.group(1))


def find_resume_checkpoint(root: str | os.PathLike, resume_mode: str, resume_from_path: str | None) -> Path | None:
    """The checkpoint to resume from, or None to start fresh.

    ``auto``: the one named by the tracker file (or the newest complete one); ``disable``: none;
    ``resume_path``: exactly ``resume_from_path``, which must be a complete checkpoint.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "resume_path":
        if not resume_from_path:
            raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        path = Path(resume_from_path)
        _check_complete(path, root)
        return path
    if resume_mode != "auto":
        raise CheckpointError(f"trainer.resume_mode={resume_mode!r}; valid: auto, disable, resume_path")
    complete = list_checkpoints(root)
    tracker = Path(root) / TRACKER_FILE
    if tracker.exists():
        step = tracker.read_text().strip()
        path = Path(root) / f"global_step_{step}"
        _check_complete(path, root)
        return path
    return complete[-1] if complete else None


def _check_complete(path: Path, root: str | os.PathLike) -> None:
    if path.is_dir() and (path / COMPLETE_MARKER).exists():
        return
    others = [p.name for p in list_checkpoints(root) if p != path]
    hint = f"; complete checkpoints: {others} (resume one with trainer.resume_mode=resume_path " \
           f"trainer.resume_from_path=<dir>)" if others else "; no complete checkpoint was found"
    raise CheckpointError(f"checkpoint {path} is missing or incomplete{hint}")

"""Checkpoint directories on the driver side, in verl's layout.

    <default_local_dir>/
        latest_checkpointed_iteration.txt      "<N>"
        global_step_<N>/
            actor/   critic/                   written by the workers (one shard file per rank)
            trainer_state.pt                   step, data-loader position, controller state
            MANIFEST.json                      relative path -> size of every file above
            COMPLETE                           written last

A checkpoint is written into ``global_step_<N>.tmp`` and renamed only when every part is on disk,
then the tracker file is replaced atomically, so a run killed while saving never leaves a
half-written checkpoint that resume would pick up. The manifest catches what the rename cannot: a
file truncated or overwritten later (a full disk, a bad copy) is named at resume, before loading.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
MANIFEST_FILE = "MANIFEST.json"
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
    _write_manifest(staged)
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
    raise CheckpointError(f"checkpoint {path} is missing or incomplete{_other_checkpoints_hint(path, root)}")


def _other_checkpoints_hint(path: Path, root: str | os.PathLike) -> str:
    others = [str(p) for p in list_checkpoints(root) if p.resolve() != Path(path).resolve()]
    if not others:
        return "; no other complete checkpoint was found"
    return (f"; other complete checkpoints: {others}; resume the newest of them with trainer.resume_mode=resume_path "
            f"trainer.resume_from_path={others[-1]}")


def _write_manifest(folder: Path) -> None:
    sizes = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}
    (folder / MANIFEST_FILE).write_text(json.dumps(sizes, indent=1))


def verify_checkpoint(path: str | os.PathLike, root: str | os.PathLike) -> None:
    """Check that every file listed in ``MANIFEST.json`` exists with the size it was written with.

    Raises :class:`CheckpointError` naming the first bad file and offering the other complete
    checkpoints under ``root``. Sizes, not hashes: they catch truncation at no cost even for
    checkpoints of hundreds of GB. Checkpoints written before manifests existed pass unchecked.
    """
    path = Path(path)
    manifest = path / MANIFEST_FILE
    if not manifest.exists():
        return
    try:
        sizes = json.loads(manifest.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {path} is corrupted: {manifest} is not valid JSON ({err})"
                              f"{_other_checkpoints_hint(path, root)}") from None
    for rel, size in sizes.items():
        file = path / rel
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise CheckpointError(f"checkpoint {path} is corrupted: {file} {found}, {size} were written "
                                  f"(truncated, deleted or overwritten){_other_checkpoints_hint(path, root)}")

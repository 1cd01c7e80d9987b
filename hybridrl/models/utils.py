"""Small helpers shared by every role: position ids, parameter counts, the model cache folder."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

# A Hub id is "owner/name" (or a bare "name") with no path separators beyond the one slash.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# class names of the SiLU activation modules HF models use: torch's and transformers' (ACT2FN["silu"])
SILU_CLASSES = ("SiLU", "SiLUActivation")


def models_dir() -> Path:
    """Root of the local model cache: ``$HYBRIDRL_MODELS_DIR`` if set, else ``~/.cache/hybridrl``.

    Prepared models live in sub-folders (``smollm2-135m-instruct``, ``tiny-qwen2-tiny-s0`` ...), so
    tests, examples and benchmarks share one conversion. The folder is created on first use.
    """
    root = Path(os.environ.get("HYBRIDRL_MODELS_DIR") or Path.home() / ".cache" / "hybridrl")
    root.mkdir(parents=True, exist_ok=True)
    return root


def compute_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded (and right-padded) rows: ``clamp(cumsum(mask, -1) - 1, min=0)``.

    attention_mask: (B, T) of 0/1. Returns (B, T) long; the first real token gets 0, pad positions
    before it get 0 too (they are masked anyway), pad positions after the sequence keep counting
    from the last real token's position, exactly as verl computes them.
    """
    return torch.clamp(torch.cumsum(attention_mask.long(), dim=-1) - 1, min=0)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters of ``model``; tied weights (embedding == lm_head) count once."""
    # parameters() yields each shared tensor once, so tied weights are not double counted.
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def resolve_model_dir(path: str | os.PathLike, what: str = "model") -> Path:
    """Check that ``path`` is a local Hugging Face folder and return it as a Path.

    Raises FileNotFoundError naming the path; when the string looks like a Hub id the message says so,
    since nothing can be downloaded here, and names the commands that make a local folder.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file() and what != "tokenizer":
            raise FileNotFoundError(
                f"{what} folder {str(p)!r} has no config.json; expected a Hugging Face folder"
            )
        return p
    msg = f"{what} path {str(path)!r} does not exist (resolved to {str(p.resolve())!r})"
    if _HUB_ID.match(str(path)) and "/" in str(path):
        msg += (
            ". It looks like a Hugging Face Hub id, but models cannot be downloaded here: point to a local "
            "folder, e.g. one made by `hybridrl models make-tiny --preset tiny --out DIR` or "
            "`hybridrl models prepare smollm2-135m-instruct --out DIR`"
        )
    raise FileNotFoundError(msg)


def refuse_foreign_dir(out: Path, marker: str) -> None:
    """Raise if ``out`` is a non-empty folder that we did not write (no ``marker`` file): never clobber it."""
    if out.exists() and any(out.iterdir()) and not (out / marker).exists():
        raise FileExistsError(
            f"{str(out)!r} exists, is not empty and has no {marker}: refusing to overwrite it"
        )


@contextlib.contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to build into; removed on exit (after ``publish_dir`` or on error)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish_dir(tmp: Path, out: Path, is_ready: Callable[[], bool]) -> None:
    """Rename the finished ``tmp`` to ``out``, replacing a stale build.

    Concurrent builders (parallel tests) race here; whoever loses checks ``is_ready()`` and keeps the
    winner's identical folder. Permissions are opened up (mkdtemp makes 0700) so a shared cache is readable.
    """
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if is_ready():
        return
    if out.exists():
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:
        if not is_ready():
            raise

"""Generation dumps: JSONL files of prompts, responses and scores.

The trainer's dumps follow verl (``trainer.rollout_data_dir`` / ``trainer.validation_data_dir``):
one file ``<dir>/<step>.jsonl`` per step, one JSON object per sample with ``input``, ``output``,
``score``, ``step`` and every per-sample reward extra (``reward_extra_info`` of the reward
manager). ``hybridrl eval`` writes its samples with the same writer, and ``hybridrl plot`` shows
the newest dump in the run report.

Wiring in the trainer (after ``score`` in ``collect_batch``; the reward manager has the tokenizer)::

    if trainer.rollout_data_dir:
        dump_batch(trainer.rollout_data_dir, self.global_step, self.reward_fn.tokenizer, batch,
                   batch.meta_info.get("reward_extra"))
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

_STEP_FILE = re.compile(r"^(\d+)\.jsonl$")


def _jsonable(value: Any) -> Any:
    """numpy scalars/arrays and tensors as plain Python; NaN/inf as strings (JSON has neither)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> Path:
    """Write ``records`` one JSON object per line (UTF-8, not ASCII-escaped); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(_jsonable(record), ensure_ascii=False) + "\n")
    return path


def decode_generations(tokenizer, batch) -> tuple[list[str], list[str]]:
    """(prompt texts, response texts) of a rollout DataProto: ``prompts (B,P)`` without padding and
    ``responses (B,R)`` up to their ``response_mask`` length, special tokens skipped (as verl)."""
    b = batch.batch
    prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(b["prompts"], b["attention_mask"][:, : b["prompts"].shape[1]])]
    lengths = b["response_mask"].sum(-1).tolist()
    response_ids = [row[: int(n)].tolist() for row, n in zip(b["responses"], lengths)]
    return (tokenizer.batch_decode(prompt_ids, skip_special_tokens=True),
            tokenizer.batch_decode(response_ids, skip_special_tokens=True))


def dump_generations(dump_dir: str | os.PathLike, step: int, inputs: Sequence[str], outputs: Sequence[str],
                     scores: Sequence[float], reward_extra: dict[str, Sequence[Any]] | None = None) -> Path:
    """Write ``<dump_dir>/<step>.jsonl``: one object per sample with input, output, score, step and
    the per-sample ``reward_extra`` columns (each a list of the same length)."""
    columns = {"input": list(inputs), "output": list(outputs), "score": list(scores)}
    for key, values in (reward_extra or {}).items():
        columns.setdefault(key, list(values))
    lengths = {key: len(values) for key, values in columns.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"dump_generations: columns have different lengths {lengths}")
    count = lengths["input"]
    records = ({**{k: v[i] for k, v in columns.items()}, "step": step} for i in range(count))
    return write_jsonl(Path(dump_dir) / f"{step}.jsonl", records)


def latest_dump(dump_dir: str | os.PathLike) -> tuple[int, Path] | None:
    """(step, path) of the highest-numbered ``<step>.jsonl`` in ``dump_dir``, or None."""
    folder = Path(dump_dir)
    if not folder.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE.match(p.name))]
    return max(found) if found else None


def read_jsonl(path: str | os.PathLike, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` records (all if None) of a JSONL file; a bad line names the file and line."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path} line {number}: not JSON ({err})") from err
    return out


def dump_batch(dump_dir: str | os.PathLike, step: int, tokenizer, batch,
               reward_extra: dict[str, Sequence[Any]] | None = None) -> Path:
    """``dump_generations`` of a scored rollout DataProto: decoded prompts and responses, and the
    sequence score ``token_level_scores.sum(-1)`` (what the advantage estimator saw)."""
    inputs, outputs = decode_generations(tokenizer, batch)
    scores = batch.batch["token_level_scores"].sum(-1).tolist()
    return dump_generations(dump_dir, step, inputs, outputs, scores, reward_extra)

"""Preprocessing into verl's parquet schema (like verl's ``examples/data_preprocess/``).

    python -m hybridrl.data.preprocess gsm8k --input ../shared/data/gsm8k --out ~/data/gsm8k
    python -m hybridrl.data.preprocess math --input DIR_WITH_train/test.jsonl --out ~/data/math
    python -m hybridrl.data.preprocess addition --out ~/data/addition --n 20000 --seed 0

Writes ``train.parquet`` and ``test.parquet`` under ``--out``. gsm8k and math read local files
(``train``/``test`` as ``.jsonl`` or ``.parquet``, also the Hugging Face ``train-00000-of-00001.parquet``
layout); nothing is downloaded. The synthetic tasks (addition, reverse, sort, countdown) are
generated from ``--seed``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hybridrl.data.files import DataFileError, RowFile
from hybridrl.data.synthetic import TASKS, generate_splits
from hybridrl.rewards.math_answer import last_boxed_only_string, remove_boxed

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SPLITS = ("train", "test")
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def find_split_file(input_path: str | Path, split: str) -> Path | None:
    """The file holding ``split`` under ``input_path``: ``{split}.jsonl|.parquet`` or ``{split}-*.parquet``,
    directly or one folder down (``main/`` in the Hugging Face layout)."""
    root = Path(input_path).expanduser()
    for folder in [root, *sorted(p for p in root.glob("*") if p.is_dir())]:
        for pattern in (f"{split}.jsonl", f"{split}.parquet", f"{split}-*.parquet"):
            hits = sorted(folder.glob(pattern))
            if hits:
                return hits[0]
    return None


def _split_files(input_path: str | Path) -> dict[str, RowFile]:
    files = {s: f for s in SPLITS if (f := find_split_file(input_path, s)) is not None}
    if not files:
        raise FileNotFoundError(f"no train/test .jsonl or .parquet files under {input_path}")
    return {s: RowFile(f) for s, f in files.items()}


def gsm8k_answer(answer: str, where: str) -> str:
    """The number after ``#### `` in a GSM8K solution, commas removed (verl's preprocessing)."""
    found = _GSM8K_ANSWER.search(answer)
    if found is None:
        raise DataFileError(f"{where} column 'answer': no '#### <number>' final answer")
    return found.group(1).replace(",", "")


def gsm8k_rows(f: RowFile, split: str) -> list[dict[str, Any]]:
    """GSM8K ``question``/``answer`` rows -> verl rows (exactly the columns verl's gsm8k.py writes)."""
    rows = []
    for i, (question, answer) in enumerate(zip(f.column("question"), f.column("answer"))):
        rows.append(
            {
                "data_source": GSM8K_SOURCE,
                "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": gsm8k_answer(answer, f"{f.path} row {i}")},
                "extra_info": {"split": split, "index": i, "answer": answer, "question": question},
            }
        )
    return rows


def math_rows(f: RowFile, split: str, data_source: str = MATH_SOURCE) -> list[dict[str, Any]]:
    """MATH ``problem``/``solution`` rows -> verl rows; the ground truth is the last ``\\boxed{}``."""
    rows = []
    for i, (problem, solution) in enumerate(zip(f.column("problem"), f.column("solution"))):
        boxed = last_boxed_only_string(solution)
        if boxed is None:
            raise DataFileError(f"{f.path} row {i} column 'solution': no \\boxed{{...}} final answer")
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": problem + " " + MATH_INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": remove_boxed(boxed)},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def write_splits(splits: dict[str, list[dict[str, Any]]], out_dir: str | Path) -> dict[str, Path]:
    """Write ``{split}.parquet`` for each split; returns the paths."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths


def prepare(task: str, out_dir: str | Path, input_path: str | Path | None = None, n: int = 10000,
            n_test: int = 500, seed: int = 0, **knobs: Any) -> dict[str, Path]:
    """Build and write ``task``'s splits; returns ``{split: path}``."""
    if task in ("gsm8k", "math"):
        if input_path is None:
            raise ValueError(f"{task} needs --input (a folder with train/test .jsonl or .parquet files)")
        convert = gsm8k_rows if task == "gsm8k" else math_rows
        splits = {s: convert(f, s) for s, f in _split_files(input_path).items()}
    elif task in TASKS:
        splits = generate_splits(task, n, n_test, seed, **knobs)
    else:
        raise ValueError(f"unknown task {task!r}; choose from {['gsm8k', 'math', *sorted(TASKS)]}")
    return write_splits(splits, out_dir)


_KNOBS = {
    # task: CLI options that are difficulty knobs of its generator
    "addition": ("min_digits", "max_digits", "num_operands", "operator", "style"),
    "reverse": ("min_len", "max_len", "alphabet"),
    "sort": ("min_len", "max_len", "max_value"),
    "countdown": ("min_numbers", "max_numbers", "max_number"),
}


def build_parser(prog: str = "python -m hybridrl.data.preprocess") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Write train.parquet / test.parquet in verl's schema.")
    p.add_argument("task", choices=["gsm8k", "math", *sorted(TASKS)])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--input", help="gsm8k/math: folder with train/test .jsonl or .parquet")
    p.add_argument("--n", type=int, default=10000, help="synthetic: training rows")
    p.add_argument("--n-test", type=int, default=500, help="synthetic: test rows (never in train)")
    p.add_argument("--seed", type=int, default=0)
    for name in ("min_digits", "max_digits", "num_operands", "min_len", "max_len", "max_value",
                 "min_numbers", "max_numbers", "max_number"):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    p.add_argument("--alphabet", choices=["digits", "letters"], default=None, help="reverse: characters")
    p.add_argument("--operator", choices=["+", "*", "add", "mul"], default=None,
                   help="addition: + / add (default) or * / mul (products); quote '*' in a shell")
    p.add_argument("--style", choices=["bare", "question"], default=None,
                   help="addition: '12+345=' (bare, default) or a question for instruction-tuned models")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m hybridrl.data.preprocess") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.operator is not None:
        args.operator = {"add": "+", "mul": "*"}.get(args.operator, args.operator)
    knobs = {k: getattr(args, k) for k in _KNOBS.get(args.task, ()) if getattr(args, k) is not None}
    unused = [k for k in (*{k for ks in _KNOBS.values() for k in ks},) if getattr(args, k) is not None and k not in knobs]
    if unused:
        parser.error(f"options {sorted(unused)} do not apply to task {args.task!r}")
    paths = prepare(args.task, args.out, args.input, args.n, args.n_test, args.seed, **knobs)
    for split, path in paths.items():
        print(f"{split}: {pq.read_metadata(path).num_rows} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``hybridrl data ...``: ``prepare`` (write a dataset) and ``inspect`` (summarise a data file)."""

from __future__ import annotations

import json

from hybridrl.data import preprocess
from hybridrl.data.files import RowFile

USAGE = """usage: hybridrl data {prepare,inspect} ...

  prepare TASK --out DIR [--input DIR] [--n N] [--n-test M] [--seed S] [task knobs]
          TASK: gsm8k | math | addition | reverse | sort | countdown
  inspect FILE [--rows K]   row count, columns and the first K rows of a parquet/JSONL file
"""


def inspect_file(path: str, rows: int = 1) -> int:
    f = RowFile(path)
    print(f"{f.path}: {len(f)} rows, columns {f.columns}")
    for i in range(min(rows, len(f))):
        print(json.dumps(f.row(i), ensure_ascii=False, default=str)[:2000])
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "prepare":
        return preprocess.main(rest, prog="hybridrl data prepare")
    if command == "inspect":
        if not rest:
            print(USAGE)
            return 2
        rows = int(rest[rest.index("--rows") + 1]) if "--rows" in rest else 1
        return inspect_file(rest[0], rows)
    print(f"unknown data command {command!r}\n{USAGE}")
    return 2

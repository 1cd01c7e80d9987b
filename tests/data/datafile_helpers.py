"""Helpers for the data tests: small verl-format rows written as real parquet / JSONL files."""

import json

import pyarrow as pa
import pyarrow.parquet as pq


def verl_row(content, truth, index, source="hybridrl/addition"):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": index},
    }


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path

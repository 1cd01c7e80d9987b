"""RLHFDataset with the real tiny tokenizer on real parquet / JSONL files."""

import pytest
import torch
from datafile_helpers import verl_row, write_jsonl, write_parquet

from hybridrl.data import DataFileError, RLHFDataset, collate_prompts

P = 32


@pytest.fixture
def rows():
    # Row 3 is long: its templated prompt is over P tokens (the tiny tokenizer splits every digit).
    contents = ["1+2=", "12+34=", "999+1=", "9" * 60 + "+1=", "7+7="]
    return [verl_row(c, str(i), 100 + i) for i, c in enumerate(contents)]


@pytest.fixture(params=["parquet", "jsonl"])
def data_file(request, tmp_path, rows):
    if request.param == "parquet":
        return write_parquet(tmp_path / "train.parquet", rows)
    return write_jsonl(tmp_path / "train.jsonl", rows)


def test_item_is_left_padded_chat_prompt(data_file, tokenizer):
    ds = RLHFDataset(data_file, tokenizer, max_prompt_length=P, truncation="left", return_raw_chat=True,
                     return_full_prompt=True)
    item = ds[1]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "12+34="}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pad = P - len(ids)
    assert item["input_ids"].tolist() == [tokenizer.pad_token_id] * pad + ids
    assert item["attention_mask"].tolist() == [0] * pad + [1] * len(ids)
    assert item["position_ids"].tolist() == [0] * pad + list(range(len(ids)))
    assert item["raw_prompt"] == [{"role": "user", "content": "12+34="}]
    assert item["full_prompts"] == text
    assert item["index"] == 101 and item["data_source"] == "hybridrl/addition"
    assert item["reward_model"]["ground_truth"] == "1" and item["ability"] == "math"
    assert "prompt" not in item


def test_collate_gives_dataproto(data_file, tokenizer):
    ds = RLHFDataset(data_file, tokenizer, max_prompt_length=P, truncation="left")
    batch = collate_prompts([ds[i] for i in range(4)], add_uid=True)
    assert len(batch) == 4
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch.batch[key].shape == (4, P) and batch.batch[key].dtype == torch.long
    assert {"data_source", "reward_model", "extra_info", "index", "ability", "uid"} <= set(batch.non_tensor_batch)
    assert batch.non_tensor_batch["reward_model"][2] == {"style": "rule", "ground_truth": "2"}
    assert len(set(batch.non_tensor_batch["uid"])) == 4
    assert "uid" not in ds.collate([ds[0]]).non_tensor_batch


def test_truncation_modes(data_file, tokenizer):
    long_text = tokenizer.apply_chat_template([{"role": "user", "content": "9" * 60 + "+1="}],
                                              add_generation_prompt=True, tokenize=False)
    full = tokenizer(long_text, add_special_tokens=False)["input_ids"]
    assert len(full) > P
    left = RLHFDataset(data_file, tokenizer, max_prompt_length=P, truncation="left")[3]
    right = RLHFDataset(data_file, tokenizer, max_prompt_length=P, truncation="right")[3]
    assert left["input_ids"].tolist() == full[-P:] and left["attention_mask"].all()
    assert right["input_ids"].tolist() == full[:P]
    strict = RLHFDataset(data_file, tokenizer, max_prompt_length=P, truncation="error")
    strict[0]  # short prompts are fine
    with pytest.raises(DataFileError, match=rf"{data_file.name} row 3: the prompt is {len(full)} tokens"):
        strict[3]
    with pytest.raises(ValueError, match="truncation must be one of"):
        RLHFDataset(data_file, tokenizer, truncation="middle")


def test_filter_overlong_prompts(data_file, tokenizer):
    ds = RLHFDataset(data_file, tokenizer, max_prompt_length=P, filter_overlong_prompts=True)
    assert len(ds) == 4
    assert [ds[i]["index"] for i in range(4)] == [100, 101, 102, 104]
    with pytest.raises(DataFileError, match="every prompt is longer"):
        RLHFDataset(data_file, tokenizer, max_prompt_length=3, filter_overlong_prompts=True)


def test_several_files_and_prompt_key(tmp_path, tokenizer, rows):
    other = [dict(r, question=r.pop("prompt")) for r in [dict(x) for x in rows[:2]]]
    a = write_parquet(tmp_path / "a.parquet", other)
    b = write_jsonl(tmp_path / "b.jsonl", other)
    ds = RLHFDataset([a, b], tokenizer, max_prompt_length=P, prompt_key="question")
    assert len(ds) == 4 and torch.equal(ds[0]["input_ids"], ds[2]["input_ids"])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r.pop("prompt"), r"row 2.*'prompt'"),
        (lambda r: r.update(prompt="just a string"), r"row 2 column 'prompt': expected a non-empty list"),
        (lambda r: r.update(prompt=[{"role": "user"}]), r"row 2 column 'prompt': message 0 must be a dict"),
        (lambda r: r.update(data_source=None), r"row 2: column 'data_source' is (missing or )?null"),
    ],
)
def test_malformed_jsonl_row_named(tmp_path, tokenizer, rows, mutate, match):
    mutate(rows[2])
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataFileError, match=match) as info:
        RLHFDataset(path, tokenizer, max_prompt_length=P)
    assert "bad.jsonl" in str(info.value)


def test_malformed_parquet_rows_named(tmp_path, tokenizer, rows):
    rows[2]["prompt"] = [{"role": "user", "content": None}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataFileError, match=r"bad.parquet row 2 column 'prompt': message 0"):
        RLHFDataset(path, tokenizer, max_prompt_length=P)
    rows[2]["prompt"] = [{"role": "user", "content": "1+1="}]
    rows[4]["data_source"] = None
    with pytest.raises(DataFileError, match=r"bad2.parquet row 4: column 'data_source' is null"):
        RLHFDataset(write_parquet(tmp_path / "bad2.parquet", rows), tokenizer)
    for r in rows:
        r["data_source"] = 7
    with pytest.raises(DataFileError, match=r"column 'data_source' must hold str values, but its type is int64"):
        RLHFDataset(write_parquet(tmp_path / "bad3.parquet", rows), tokenizer)
    for r in rows:
        r["data_source"] = "hybridrl/addition"
        del r["reward_model"]
    with pytest.raises(DataFileError, match=r"column 'reward_model' is missing; columns are"):
        RLHFDataset(write_parquet(tmp_path / "bad4.parquet", rows), tokenizer)


def test_broken_files(tmp_path, tokenizer, rows):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataFileError, match="empty.jsonl: the file has no rows"):
        RLHFDataset(empty, tokenizer)
    write_parquet(tmp_path / "empty.parquet", rows)
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(tmp_path / "empty.parquet").slice(0, 0), tmp_path / "empty.parquet")
    with pytest.raises(DataFileError, match="empty.parquet: the file has no rows"):
        RLHFDataset(tmp_path / "empty.parquet", tokenizer)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet")
    with pytest.raises(DataFileError, match="garbage.parquet: not a readable parquet file"):
        RLHFDataset(garbage, tokenizer)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": []}\n{oops\n')
    with pytest.raises(DataFileError, match=r"bad.jsonl row 1 \(line 2\): invalid JSON"):
        RLHFDataset(bad_json, tokenizer)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        RLHFDataset(tmp_path / "nope.parquet", tokenizer)

"""SFTDataset: single-turn rows with dict keys, multi-turn assistant masks, truncation, collate layout."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridrl.data import RLHFDataset
from hybridrl.data.files import DataFileError
from hybridrl.data.sft_dataset import SFTDataset, collate_sft
from hybridrl.data.synthetic import make_row

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "and 4+5="},
    {"role": "assistant", "content": "9"},
    {"role": "user", "content": "thanks"},
]


@pytest.fixture
def addition_file(tmp_path):
    rows = [make_row("hybridrl/addition", f"{a}+{b}=", str(a + b), str(a + b), "math", "train", i)
            for i, (a, b) in enumerate([(12, 345), (7, 8), (99, 1)])]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_single_turn_dict_keys_match_rollout_prompt_and_end_with_eos(addition_file, tokenizer):
    ds = SFTDataset(addition_file, tokenizer, prompt_key="prompt", response_key="extra_info",
                    response_dict_keys=["solution"])
    rl = RLHFDataset(addition_file, tokenizer, max_prompt_length=64)
    ex = ds[0]
    rl_ids = rl[0]["input_ids"][rl[0]["attention_mask"].bool()].tolist()
    assert ex.prompt_ids == rl_ids  # SFT sees the prompt exactly as rollout will
    assert tokenizer.decode(ex.response_ids) == "357<|im_end|>"
    assert ex.response_ids[-1] == tokenizer.eos_token_id and ex.loss_mask == [1] * len(ex.response_ids)


def test_string_prompt_is_one_user_message_and_prompt_dict_keys(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", [{"q": {"text": "2+2="}, "a": "4"}])
    ex = SFTDataset(path, tokenizer, prompt_key="q", prompt_dict_keys=["text"], response_key="a")[0]
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True,
                                             tokenize=False)
    assert tokenizer.decode(ex.prompt_ids) == expected


def test_missing_dict_key_names_file_row_and_keys(addition_file, tokenizer):
    ds = SFTDataset(addition_file, tokenizer, prompt_key="prompt", response_key="extra_info",
                    response_dict_keys=["answer"])
    with pytest.raises(DataFileError, match=r"train.parquet row 1 column 'extra_info': no key 'answer'.*solution"):
        ds[1]


def test_multiturn_mask_covers_assistant_tokens_and_end_of_turn_only(tmp_path, tokenizer):
    ds = SFTDataset(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}]), tokenizer, multiturn=True)
    ex = ds[0]
    assert tokenizer.decode(ex.prompt_ids) == tokenizer.apply_chat_template(CHAT[:2], add_generation_prompt=True,
                                                                           tokenize=False)
    trained = [t for t, m in zip(ex.response_ids, ex.loss_mask) if m]
    assert tokenizer.decode(trained) == "3<|im_end|>9<|im_end|>"
    untrained = tokenizer.decode([t for t, m in zip(ex.response_ids, ex.loss_mask) if not m])
    assert untrained == "\n<|im_start|>user\nand 4+5=<|im_end|>\n<|im_start|>assistant\n"
    # prompt + response is the rendered chat up to the last assistant's end-of-turn token
    full = tokenizer.apply_chat_template(CHAT[:5], tokenize=False)
    assert tokenizer.decode(ex.prompt_ids + ex.response_ids) == full[: full.rindex("<|im_end|>") + len("<|im_end|>")]


def test_multiturn_without_assistant_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[:2]}])
    with pytest.raises(DataFileError, match=r"chat.jsonl row 0 column 'messages': a conversation needs an assistant"):
        SFTDataset(path, tokenizer, multiturn=True)[0]


def test_truncation_modes(addition_file, tokenizer):
    kwargs = dict(prompt_key="prompt", response_key="extra_info", response_dict_keys=["solution"])
    full = SFTDataset(addition_file, tokenizer, **kwargs)[0]
    total = len(full.prompt_ids) + len(full.response_ids)
    with pytest.raises(DataFileError, match=rf"row 0: the example is {total} tokens .* data.max_length={total - 2}"):
        SFTDataset(addition_file, tokenizer, max_length=total - 2, **kwargs)[0]
    left = SFTDataset(addition_file, tokenizer, max_length=total - 2, truncation="left", **kwargs)[0]
    assert left.prompt_ids == full.prompt_ids[2:] and left.response_ids == full.response_ids
    right = SFTDataset(addition_file, tokenizer, max_length=total - 2, truncation="right", **kwargs)[0]
    assert right.prompt_ids == full.prompt_ids and right.response_ids == full.response_ids[:-2]


def test_collate_layout_left_padded_prompt_right_padded_response(tmp_path, tokenizer):
    ds = SFTDataset(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}]), tokenizer, multiturn=True)
    long_ex = ds[0]
    short = type(long_ex)([5, 6], [7], [1])
    batch = collate_sft([long_ex, short], pad_token_id=0).batch
    p, r = len(long_ex.prompt_ids), len(long_ex.response_ids)
    assert batch["input_ids"].shape == (2, p + r) and batch["responses"].shape == (2, r)
    assert batch["input_ids"][1, p - 2: p + 1].tolist() == [5, 6, 7]
    assert batch["attention_mask"][1].tolist() == [0] * (p - 2) + [1, 1, 1] + [0] * (r - 1)
    assert batch["response_mask"][1].tolist() == [1] + [0] * (r - 1)
    assert batch["response_mask"][0].tolist() == long_ex.loss_mask
    expected_pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(batch["position_ids"], expected_pos)
    assert batch["attention_mask"][0].sum() == p + r  # user turns inside the response stay visible

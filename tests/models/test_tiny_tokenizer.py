"""The built-in tokenizer: round trips, single-digit tokens, ChatML, save/reload, determinism."""

import pytest
from transformers import AutoTokenizer

from hybridrl.models import load_tokenizer, save_tiny_tokenizer
from hybridrl.models.tiny_tokenizer import CHATML_TEMPLATE

TEXTS = [
    "What is 123 + 4567? The answer is 4690.",
    "Natalia sold 48 clips in April.\n#### 72",
    "<think>3 * 7 = 21</think> <answer>21</answer>",
    "  leading spaces, tabs\tand unicode: café ∑ 漢字 🙂",
    "Sort the list [5, 3, 9]: [3, 5, 9]",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tiny_tokenizer, text):
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text


def test_vocab_size_and_special_ids(tiny_tokenizer):
    assert 512 <= len(tiny_tokenizer) <= 2048
    assert tiny_tokenizer.pad_token == "<|endoftext|>" and tiny_tokenizer.pad_token_id == 0
    assert tiny_tokenizer.eos_token == "<|im_end|>" and tiny_tokenizer.eos_token_id == 2
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    # Special tokens written in text are one id each, never split into bytes.
    ids = tiny_tokenizer("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_are_single_tokens(tiny_tokenizer):
    ids = tiny_tokenizer("1234567890", add_special_tokens=False)["input_ids"]
    assert [tiny_tokenizer.decode([i]) for i in ids] == list("1234567890")
    assert len(set(ids)) == 10
    # No learned merge contains a digit: every vocab entry with a digit is exactly that digit.
    with_digit = [t for t in tiny_tokenizer.get_vocab() if any(c in "0123456789" for c in t)]
    assert sorted(with_digit) == list("0123456789")
    # A number after a space still splits into its digits (the space is its own token).
    pieces = [
        tiny_tokenizer.decode([i]) for i in tiny_tokenizer(" 407", add_special_tokens=False)["input_ids"]
    ]
    assert pieces[-3:] == ["4", "0", "7"]


def test_chat_template_renders_chatml(tiny_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    prompt = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == text + "<|im_start|>assistant\n"


def test_save_reload_with_auto_tokenizer(tiny_tokenizer, tmp_path):
    save_tiny_tokenizer(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.get_vocab() == tiny_tokenizer.get_vocab()
    assert reloaded.chat_template == CHATML_TEMPLATE
    assert (reloaded.eos_token, reloaded.pad_token) == ("<|im_end|>", "<|endoftext|>")
    for text in TEXTS:
        assert reloaded(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]


def test_load_tokenizer_sets_padding_side(tmp_path):
    save_tiny_tokenizer(tmp_path)
    left = load_tokenizer(tmp_path)
    batch = left(["1", "1 + 2 = 3"], padding=True)["attention_mask"]
    assert left.padding_side == "left" and batch[0][0] == 0 and batch[0][-1] == 1
    right = load_tokenizer(tmp_path, padding_side="right")
    assert right(["1", "1 + 2 = 3"], padding=True)["attention_mask"][0][-1] == 0
    with pytest.raises(ValueError, match="padding_side"):
        load_tokenizer(tmp_path, padding_side="middle")


def test_same_bytes_every_time(tmp_path):
    a, b = save_tiny_tokenizer(tmp_path / "a"), save_tiny_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()

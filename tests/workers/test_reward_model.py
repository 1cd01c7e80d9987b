"""The reward model's re-templating: the prompt's chat plus the decoded response, in its own template."""

import numpy as np
import pytest
import torch

from hybridrl.models import build_tiny_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.workers.reward_model import retemplate


def _batch(tokenizer, with_chat: bool = True) -> DataProto:
    prompts = [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+3?"}]]
    answers = ["2", "five"]
    p, r = 12, 6
    ids = torch.full((2, p + r), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(2, p + r, dtype=torch.long)
    for i, (chat, answer) in enumerate(zip(prompts, answers)):
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        if not isinstance(prompt, list):
            prompt = prompt["input_ids"]
        response = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids[i, p - len(prompt):p], mask[i, p - len(prompt):p] = torch.tensor(prompt), 1
        ids[i, p:p + len(response)], mask[i, p:p + len(response)] = torch.tensor(response), 1
    non_tensor = {"raw_prompt": np.array(prompts, dtype=object)} if with_chat else {}
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, p:]}, non_tensor)


def test_rows_are_the_chat_plus_the_response_in_the_reward_models_template():
    tokenizer = build_tiny_tokenizer()
    data = _batch(tokenizer)
    out = retemplate(data, tokenizer, tokenizer, None)
    ids, mask = out.batch["input_ids"], out.batch["attention_mask"]
    assert ids.shape == data.batch["input_ids"].shape and torch.equal(out.batch["responses"], ids[:, 1:])
    for i, (chat, answer) in enumerate(zip(data.non_tensor_batch["raw_prompt"], ["2", "five"])):
        want = tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": answer}], tokenize=False)
        n = int(mask[i].sum())
        assert mask[i, :n].all() and not mask[i, n:].any()  # right-padded
        assert tokenizer.decode(ids[i, :n].tolist()) == want
    short = retemplate(data, tokenizer, tokenizer, 5)  # cut on the right
    assert short.batch["input_ids"].shape[1] == 5 and torch.equal(short.batch["input_ids"], ids[:, :5])


def test_rows_without_their_chat_say_which_setting_supplies_it():
    tokenizer = build_tiny_tokenizer()
    with pytest.raises(KeyError, match="set data.return_raw_chat=true"):
        retemplate(_batch(tokenizer, with_chat=False), tokenizer, tokenizer, None)

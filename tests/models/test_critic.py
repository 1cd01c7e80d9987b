"""Critic: backbone + value head, loading from an actor folder, save/load round trip."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybridrl.models import CriticModel, compute_position_ids, load_critic, load_tokenizer, save_critic
from hybridrl.models.critic import VALUE_HEAD_FILE, VALUE_HEAD_MARKER

pytestmark = pytest.mark.component


@pytest.fixture(scope="module")
def batch(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    enc = tok(["What is 2+3?", "Sort the list [9, 4, 7] please"], return_tensors="pt", padding=True)
    enc["position_ids"] = compute_position_ids(enc["attention_mask"])
    return dict(enc)


def test_forward_shape_and_grads(tiny_dir, batch):
    critic = load_critic(tiny_dir)
    assert isinstance(critic, CriticModel)
    values = critic(**batch)
    assert values.shape == batch["input_ids"].shape and values.dtype == torch.float32
    values.sum().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0
    assert critic.backbone.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_backbone_comes_from_actor_weights(tiny_dir):
    critic = load_critic(tiny_dir)
    actor = AutoModelForCausalLM.from_pretrained(tiny_dir).model.state_dict()
    mine = critic.backbone.state_dict()
    assert mine.keys() == actor.keys()
    assert all(torch.equal(mine[k], actor[k]) for k in mine)


def test_value_head_is_seeded_and_small(tiny_dir):
    a, b, c = load_critic(tiny_dir), load_critic(tiny_dir), load_critic(tiny_dir, head_seed=1)
    assert torch.equal(a.value_head.weight, b.value_head.weight)
    assert not torch.equal(a.value_head.weight, c.value_head.weight)
    assert a.value_head.weight.abs().max() < 0.01 and torch.all(a.value_head.bias == 0)


def test_save_load_round_trip(tiny_dir, batch, tmp_path):
    critic = load_critic(tiny_dir, head_seed=5)
    with torch.no_grad():  # move the head away from its init so a re-init would be detected
        critic.value_head.weight.add_(0.5)
        critic.value_head.bias.fill_(0.25)
        want = critic(**batch)
    out = save_critic(critic, tmp_path / "critic", tokenizer=load_tokenizer(tiny_dir))
    assert json.loads((out / "config.json").read_text())[VALUE_HEAD_MARKER] == VALUE_HEAD_FILE
    assert load_file(str(out / VALUE_HEAD_FILE))["weight"].shape == (1, critic.config.hidden_size)
    reloaded = load_critic(out, head_seed=99)  # the saved head wins over a fresh one
    with torch.no_grad():
        assert torch.equal(reloaded(**batch), want)
    assert load_tokenizer(out).eos_token == "<|im_end|>"


def test_gradient_checkpointing_same_values(tiny_dir, batch):
    plain = load_critic(tiny_dir).train()
    ckpt = load_critic(tiny_dir, gradient_checkpointing=True).train()
    assert ckpt.backbone.gradient_checkpointing
    torch.testing.assert_close(ckpt(**batch), plain(**batch))


def test_marked_folder_without_head_is_an_error(tiny_dir, tmp_path):
    out = save_critic(load_critic(tiny_dir), tmp_path / "critic")
    (out / VALUE_HEAD_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=VALUE_HEAD_FILE):
        load_critic(out)

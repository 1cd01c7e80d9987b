"""Shared builders for the engine tests: tiny seeded HF models, mixed-length batches, a PG loss.

Also imported by ``dist_worker.py`` (run as a script in 2 gloo processes), so it has no pytest or
relative imports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, Qwen2Config

from hybridrl.engine.packing import real_lengths
from hybridrl.protocol import DataProto

VOCAB = 96
PAD_ID = 0


def tiny_config(**overrides) -> Qwen2Config:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def build_model(seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(**overrides), dtype=torch.float32)


class TinyCritic(nn.Module):
    """Backbone + linear value head; forward returns values (b, t), like hybridrl's critic."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = AutoModel.from_config(tiny_config(), dtype=torch.float32)
        self.value_head = nn.Linear(self.backbone.config.hidden_size, 1)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.value_head(hidden.last_hidden_state).squeeze(-1)


def make_batch(batch_size: int = 8, prompt_len: int = 12, response_len: int = 10, seed: int = 0) -> DataProto:
    """Mixed real lengths: prompts LEFT-padded (>= 1 token), responses RIGHT-padded (0..R tokens)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randint(1, prompt_len + 1, (batch_size,), generator=gen)
    r = torch.randint(0, response_len + 1, (batch_size,), generator=gen)
    p[0], r[0] = prompt_len, response_len  # one full-length row, so T is really used
    t = prompt_len + response_len
    cols = torch.arange(t)
    mask = ((cols >= prompt_len - p[:, None]) & (cols < prompt_len + r[:, None])).long()
    ids = torch.randint(1, VOCAB, (batch_size, t), generator=gen) * mask + PAD_ID * (1 - mask)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "responses": ids[:, prompt_len:],
        "response_mask": mask[:, prompt_len:].clone(),
        "advantages": torch.randn(batch_size, response_len, generator=gen),
    }
    return DataProto.from_dict(tensors=tensors)


def make_group_batch(prompts: int = 3, group: int = 4, prompt_len: int = 12, response_len: int = 10,
                     seed: int = 0) -> DataProto:
    """GRPO's layout: ``group`` consecutive rows per prompt with the same (left-padded) prompt
    tokens and positions, and responses of their own (mixed lengths, right-padded, 1..R tokens)."""
    gen = torch.Generator().manual_seed(seed)
    rows = prompts * group
    p = torch.randint(1, prompt_len + 1, (prompts,), generator=gen).repeat_interleave(group)
    p[:group] = prompt_len
    r = torch.randint(1, response_len + 1, (rows,), generator=gen)
    r[0] = response_len
    t = prompt_len + response_len
    cols = torch.arange(t)
    mask = ((cols >= prompt_len - p[:, None]) & (cols < prompt_len + r[:, None])).long()
    prompt_ids = torch.randint(1, VOCAB, (prompts, prompt_len), generator=gen).repeat_interleave(group, dim=0)
    ids = torch.cat([prompt_ids, torch.randint(1, VOCAB, (rows, response_len), generator=gen)], dim=1)
    ids = ids * mask + PAD_ID * (1 - mask)
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, prompt_len:],
        "response_mask": mask[:, prompt_len:].clone(),
        "advantages": torch.randn(rows, response_len, generator=gen),
    }
    return DataProto.from_dict(tensors=tensors)


def shared_computed(data: DataProto) -> int:
    """Token positions a forward computes with shared prompts: each distinct prompt once (trimmed
    to the longest), every row's response tokens but the last (which predicts nothing)."""
    response_len = data.batch["responses"].shape[1]
    prompt_len = data.batch["input_ids"].shape[1] - response_len
    p, r = real_lengths(data.batch["attention_mask"], response_len)
    distinct = torch.unique(data.batch["input_ids"][:, :prompt_len], dim=0).shape[0]
    return distinct * int(p.max()) + len(p) * (int(r.max()) - 1)


def pg_loss_fn(global_tokens: int):
    """-sum(log_prob * adv * mask) / global_tokens: token-mean over the whole mini-batch (all ranks)."""

    def loss_fn(outputs, micro):
        mask = micro.batch["response_mask"].float()
        loss = -(outputs["log_probs"] * micro.batch["advantages"] * mask).sum() / global_tokens
        return loss, {"pg_loss": loss.item()}

    return loss_fn


def value_loss_fn(global_tokens: int):
    def loss_fn(outputs, micro):
        mask = micro.batch["response_mask"].float()
        loss = ((outputs["values"] - micro.batch["advantages"]) ** 2 * mask).sum() / global_tokens
        return loss, {"vf_loss": loss.item()}

    return loss_fn


def reference_outputs(model: nn.Module, data: DataProto, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """The definition, on the padded batch: logits at P-1+j / temperature, log_softmax, gather."""
    b = data.batch
    r = b["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    logits = logits[:, -r - 1 : -1].float() / temperature
    log_probs = torch.log_softmax(logits, -1)
    mask = b["attention_mask"][:, -r:]
    token_lp = log_probs.gather(-1, b["responses"][..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return {"log_probs": token_lp * mask, "entropy": entropy * mask}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters (gathered if sharded) as plain CPU tensors."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().cpu().clone()
    return out


def rank_main(run: Callable[[Path, int, int], dict]) -> None:
    """Entry of a rank script started by ``tests/ranks.py`` (output folder in ``argv[1]``): join the
    group, save ``run(out, rank, world)`` to ``out/rank<r>.pt``, then tear the group down, once the
    engines ``run`` made are out of scope (``destroy_distributed`` collects them first)."""
    from hybridrl.engine import destroy_distributed, init_distributed

    out = Path(sys.argv[1])
    rank, world = init_distributed(timeout_s=120)
    torch.save(run(out, rank, world), out / f"rank{rank}.pt")
    destroy_distributed()

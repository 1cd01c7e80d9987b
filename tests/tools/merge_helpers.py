"""Train a tiny actor and critic for two TrainEngine steps and save what the merger tests compare.

Imported by the tests (world size 1, in process) and by ``merge_worker.py`` (2 gloo processes), so
it has no pytest or relative imports. Everything lands under ``out``:

    global_step_2/actor, global_step_2/critic   engine checkpoints + huggingface/ metadata
    export/                                     the actor's export_hf (the trainer's own HF folder)
    expected.pt                                 the trained models' outputs on PROBE (rank 0)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from helpers import make_batch, pg_loss_fn, value_loss_fn  # noqa: E402

from hybridrl.engine import TrainEngine  # noqa: E402
from hybridrl.model_merger import save_checkpoint_metadata  # noqa: E402
from hybridrl.models import load_causal_lm, load_critic, load_tokenizer  # noqa: E402

STEP_DIR = "global_step_2"


def probe() -> dict[str, torch.Tensor]:
    """Two left-padded rows (B=2, T=10) of fixed token ids."""
    ids = torch.arange(10, 30).reshape(2, 10)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return {"input_ids": ids * mask, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def _local_rows(batch, rank: int, world: int):
    return batch[torch.arange(len(batch)).chunk(world)[rank]]


def train_and_save(model_dir: Path, out: Path) -> None:
    """Two steps each of an actor and a critic (lr large enough to move every weight), then save."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tokenizer = load_tokenizer(model_dir)
    batches = [make_batch(batch_size=8, seed=s) for s in (3, 4)]
    tokens = [int(b.batch["response_mask"].sum()) for b in batches]
    expected = {}
    for role, model, loss in (("actor", load_causal_lm(model_dir), pg_loss_fn),
                              ("critic", load_critic(model_dir), value_loss_fn)):
        engine = TrainEngine(model, lr=1e-2, model_type="causal_lm" if role == "actor" else "value")
        for batch, count in zip(batches, tokens):
            engine.train_step(_local_rows(batch, rank, world), loss(count))
        ckpt = out / STEP_DIR / role
        engine.save_checkpoint(ckpt)
        if rank == 0:
            save_checkpoint_metadata(ckpt, engine.model, tokenizer)
        engine.model.eval()
        with torch.no_grad():
            output = engine.model(**probe())
        expected[role] = (output.logits if role == "actor" else output).detach().clone()
        if role == "actor":
            engine.export_hf(out / "export", tokenizer=tokenizer)
    if rank == 0:
        torch.save(expected, out / "expected.pt")

"""DAPO dynamic sampling (algorithm.filter_groups) in the driver, with a scripted rollout.

The rollout and the reward are test doubles here: what is under test is the driver's grouping,
filtering and refilling logic around them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrl.config import load_config
from hybridrl.protocol import DataProto
from hybridrl.trainer.metrics import Timer
from hybridrl.trainer.ppo_trainer import PPOTrainer

N_PROMPTS, N_SAMPLES = 2, 2


class ScriptedWorkers:
    """generate_sequences returns n copies per prompt; the response's first token is the score."""

    world_size = 1

    def __init__(self, scores_per_call):
        self.calls = iter(scores_per_call)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        scores = next(self.calls)
        b = len(prompts) * N_SAMPLES
        responses = torch.tensor(scores, dtype=torch.long).view(b, 1)
        return DataProto.from_dict({"responses": responses, "response_mask": torch.ones(b, 1)})


class Loader:
    def __init__(self):
        self.count = 0

    def __iter__(self):
        while True:
            self.count += 1
            yield DataProto.from_dict({"input_ids": torch.zeros(N_PROMPTS, 3, dtype=torch.long),
                                       "attention_mask": torch.ones(N_PROMPTS, 3, dtype=torch.long),
                                       "position_ids": torch.arange(3).repeat(N_PROMPTS, 1)},
                                      {"data_source": ["t"] * N_PROMPTS})

    def __len__(self):
        return 10


def reward(batch):
    scores = batch.batch["responses"][:, :1].float()
    per_sample = {"score": scores.squeeze(-1).tolist(), "acc": (scores.squeeze(-1) > 0).tolist()}
    return scores, {"reward_extra_info": per_sample, "metrics": {}}


def make_trainer(scores_per_call, max_gen=5, metric="acc"):
    cfg = load_config([f"data.train_batch_size={N_PROMPTS}", f"actor_rollout_ref.rollout.n={N_SAMPLES}",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.n_cpu_workers=1",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                       "algorithm.filter_groups.enable=true", f"algorithm.filter_groups.metric={metric}",
                       f"algorithm.filter_groups.max_num_gen_batches={max_gen}"], preset="grpo_quickstart")
    trainer = PPOTrainer(cfg, ScriptedWorkers(scores_per_call), Loader(), None, reward, reward, tracking=None,
                         log_dir=".")
    trainer.train_iter = iter(trainer.train_loader)
    return trainer


def test_groups_without_variance_are_dropped_and_refilled():
    # call 1: prompt A scores (1,1) -> dropped, prompt B (0,1) kept; call 2: C (0,0) dropped, D (1,0) kept
    trainer = make_trainer([[1, 1, 0, 1], [0, 0, 1, 0]])
    metrics = {}
    batch = trainer.collect_batch(Timer(), metrics)
    assert len(batch) == N_PROMPTS * N_SAMPLES
    assert batch.batch["token_level_scores"].view(-1).tolist() == [0.0, 1.0, 1.0, 0.0]
    uids = batch.non_tensor_batch["uid"].tolist()
    assert uids[0] == uids[1] and uids[2] == uids[3] and uids[0] != uids[2]
    assert [row["acc"] for row in batch.non_tensor_batch["reward_extra"]] == [False, True, True, False]
    assert metrics["train/num_gen_batches"] == 2.0


def test_gives_up_after_max_num_gen_batches():
    trainer = make_trainer([[1, 1, 0, 0]] * 3, max_gen=3)
    with pytest.raises(RuntimeError, match="max_num_gen_batches=3"):
        trainer.collect_batch(Timer(), {})


def test_score_and_seq_reward_metrics():
    trainer = make_trainer([[1, 0, 1, 0]], metric="score")
    batch = trainer.collect_batch(Timer(), {})  # "score" is a reward output: accepted
    assert len(batch) == 4
    trainer = make_trainer([[1, 0, 1, 0]], metric="seq_reward")
    assert np.allclose(trainer.collect_batch(Timer(), {}).batch["token_level_scores"].sum(-1).numpy(), [1, 0, 1, 0])


def test_generation_batches_hold_gen_batch_size_prompts(tmp_path):
    """verl's data.gen_batch_size (the DAPO recipe's 3 x train_batch_size): each batch the real
    prompt loader hands the trainer, one generation batch, holds that many prompts; a step still
    trains on train_batch_size of them, and an epoch has dataset / gen_batch_size steps."""
    from e2e_helpers import config, make_assets

    from hybridrl.trainer.main_ppo import build_loaders, load_prompt_tokenizer, total_training_steps

    assets = make_assets(tmp_path)  # 64 training prompts
    cfg = config(assets, tmp_path / "run", **{"data.gen_batch_size": 8, "algorithm.filter_groups.enable": True,
                                              "trainer.total_training_steps": "null"})
    assert (cfg.data.train_batch_size, cfg.data.gen_batch_size) == (4, 8)
    train, _ = build_loaders(cfg, load_prompt_tokenizer(cfg))
    assert [len(batch) for batch, _ in zip(train, range(3))] == [8, 8, 8]
    assert total_training_steps(cfg, train) == 64 // 8 * cfg.trainer.total_epochs

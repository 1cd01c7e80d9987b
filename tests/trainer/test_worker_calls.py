"""How the driver sends its worker calls: independent calls all sent before the first is awaited,
each timed under its own phase, with only the columns the call reads.

The workers are a recording test double: what is under test is the driver's order of sending,
waiting and timing (the real worker groups run in test_ppo_e2e.py, on Ray and locally)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from hybridrl.config import load_config
from hybridrl.protocol import DataProto
from hybridrl.trainer.metrics import Timer
from hybridrl.trainer.ppo_trainer import ACTOR_UPDATE_KEYS, MODEL_INPUT_KEYS, PPOTrainer, columns

RUN_S = {"compute_log_prob": 0.05, "compute_ref_log_prob": 0.03, "update_actor": 0.06, "sync_weights": 0.02}


class RecordingWorkers:
    """Records sends and waits; a call 'runs' (sleeps) when awaited, like the local backend."""

    world_size = 1

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self.events: list[tuple[str, str]] = []
        self.sent: dict[str, DataProto] = {}
        self.joined: dict[str, list[str]] = {}
        self.names: dict[int, str] = {}

    def submit(self, name, *args, joins=()):
        self.events.append(("send", name))
        if args:
            self.sent[name] = args[0]
        if joins:
            self.joined[name] = [self.names[id(j)] for j in joins]

        def wait():
            self.events.append(("wait", name))
            time.sleep(RUN_S[name])
            if name == "update_actor":
                return {"actor/pg_loss": 1.0}
            if name == "sync_weights":
                return None
            rows = len(args[0])
            key = "old_log_probs" if name == "compute_log_prob" else "ref_log_probs"
            return DataProto.from_dict({key: torch.full((rows, 2), RUN_S[name])})

        self.names[id(wait)] = name
        return wait


def make_trainer(workers, prefetched):
    cfg = load_config(["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "trainer.n_cpu_workers=1",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"], preset="grpo_quickstart")

    class Loader:
        def prefetch(self):
            prefetched.append(list(workers.events))

        def __len__(self):
            return 10

    trainer = PPOTrainer(cfg, workers, Loader(), None, None, None, tracking=None, log_dir=".")
    assert trainer.needs_old_log_probs and trainer.use_ref  # two mini-batches, KL loss: both forwards
    return trainer


def full_batch(rows=4):
    cols = {k: torch.ones(rows, 5, dtype=torch.long) for k in ("input_ids", "attention_mask", "position_ids")}
    cols |= {k: torch.ones(rows, 2) for k in ("responses", "response_mask", "advantages", "returns",
                                              "token_level_scores", "token_level_rewards", "rollout_log_probs")}
    cols["prompts"] = torch.ones(rows, 3, dtype=torch.long)
    return DataProto.from_dict(cols, {"uid": np.array(["a", "a", "b", "b"], dtype=object)}, {"global_step": 1})


def test_log_prob_calls_are_sent_together_with_the_model_inputs_only():
    workers = RecordingWorkers(asynchronous=True)
    trainer = make_trainer(workers, [])
    timer = Timer()
    batch = trainer.score_with_models(full_batch(), timer, {})
    assert workers.events == [("send", "compute_log_prob"), ("send", "compute_ref_log_prob"),
                              ("wait", "compute_log_prob"), ("wait", "compute_ref_log_prob")]
    for name in ("compute_log_prob", "compute_ref_log_prob"):
        sent = workers.sent[name]
        assert sorted(sent.batch) == sorted(MODEL_INPUT_KEYS) and not sent.non_tensor_batch
        assert sent.meta_info == {"global_step": 1}
    assert batch.batch["old_log_probs"].eq(0.05).all() and batch.batch["ref_log_probs"].eq(0.03).all()
    assert "prompts" in batch.batch and list(batch.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    # each phase is the time spent waiting for its own call
    assert timer.timing["old_log_prob"] == pytest.approx(0.05, abs=0.03)
    assert timer.timing["ref"] == pytest.approx(0.03, abs=0.02)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_update_and_weight_sync_are_sent_together_and_prompts_made_meanwhile(asynchronous):
    workers = RecordingWorkers(asynchronous)
    prefetched = []
    trainer = make_trainer(workers, prefetched)
    timer = Timer()
    results = trainer.run_calls(timer, [("update_actor", "update_actor", full_batch()),
                                        ("update_weights", "sync_weights")], meanwhile=trainer.prefetch_prompts)
    assert results == [{"actor/pg_loss": 1.0}, None]
    assert workers.events == [("send", "update_actor"), ("send", "sync_weights"),
                              ("wait", "update_actor"), ("wait", "sync_weights")]
    # the next prompts are made after both calls are sent, only while they run elsewhere
    assert prefetched == ([[("send", "update_actor"), ("send", "sync_weights")]] if asynchronous else [])
    assert timer.timing["update_actor"] == pytest.approx(0.06, abs=0.03)
    assert timer.timing["update_weights"] == pytest.approx(0.02, abs=0.02)


def test_the_actor_update_gets_the_columns_its_loss_reads():
    batch = full_batch()
    batch.batch["old_log_probs"] = torch.zeros(4, 2)
    sent = columns(batch, ACTOR_UPDATE_KEYS)
    assert sorted(sent.batch) == sorted(["input_ids", "attention_mask", "position_ids", "responses",
                                         "response_mask", "advantages", "old_log_probs", "rollout_log_probs"])
    assert not sent.non_tensor_batch and sent.meta_info == {"global_step": 1}


def test_no_prompts_are_made_after_the_last_step():
    prefetched = []
    trainer = make_trainer(RecordingWorkers(asynchronous=True), prefetched)
    trainer.global_step = trainer.total_steps - 1
    trainer.prefetch_prompts()
    trainer.global_step = trainer.total_steps
    trainer.prefetch_prompts()
    assert len(prefetched) == 1


def test_the_update_is_sent_with_the_log_prob_calls_and_joins_their_outputs():
    workers = RecordingWorkers(asynchronous=True)
    prefetched = []
    trainer = make_trainer(workers, prefetched)
    assert trainer.joins_log_probs  # GRPO: the advantages read no log-probs
    trainer.global_step = 1
    batch = full_batch()
    batch.batch["token_level_scores"] = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    timer, metrics = Timer(), {}
    batch, finite = trainer.update_with_log_probs(batch, timer, metrics)
    names = ["compute_log_prob", "compute_ref_log_prob", "update_actor", "sync_weights"]
    assert workers.events == [("send", n) for n in names] + [("wait", n) for n in names]
    assert workers.joined == {"update_actor": ["compute_log_prob", "compute_ref_log_prob"]}
    sent = workers.sent["update_actor"]
    assert "advantages" in sent.batch and "old_log_probs" not in sent.batch  # joined on the ranks
    assert sent.meta_info["unchecked_log_probs"] is True
    assert finite and metrics["actor/pg_loss"] == 1.0
    assert batch.batch["old_log_probs"].eq(0.05).all() and batch.batch["ref_log_probs"].eq(0.03).all()
    assert list(timer.timing) == ["adv", "old_log_prob", "ref", "update_actor", "update_weights"]
    assert len(prefetched) == 1

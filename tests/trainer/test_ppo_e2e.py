"""End to end on CPU: Ray worker groups of 2 gloo ranks (FSDP2 shards or whole replicas), GRPO and PPO with a critic."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import EXPECTED_KEYS, all_finite, comparable, config, make_assets, read_metrics
from safetensors.torch import load_file

from hybridrl.trainer.main_ppo import run
from hybridrl.trainer.ppo_trainer import PPOTrainer

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("e2e_assets"))


def _weights(folder):
    return load_file(str(next(iter(sorted(folder.glob("*.safetensors"))))))


def test_grpo_two_ranks_trains_and_logs_verl_metrics(assets, tmp_path, ray_session):
    run_dir = tmp_path / "grpo"
    cfg = config(assets, run_dir, **{"trainer.save_freq": 2, "actor_rollout_ref.actor.checkpoint.save_contents": "[model,optimizer,extra,hf_model]"})
    run(cfg)
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        assert all_finite(metrics[step]), metrics[step]
        missing = [k for k in EXPECTED_KEYS if k not in metrics[step]]
        assert not missing, missing
        # the ranks generated and trained for most of the step; the rest is the controller's
        inside, step_s = metrics[step]["perf/time_in_workers"], metrics[step]["perf/time_per_step"]
        assert metrics[step]["timing_s/update_actor"] / 2 < inside < step_s
    assert "val-core/hybridrl/addition/reward/mean@1" in metrics[0]
    assert metrics[2]["actor/grad_norm"] > 0
    # parameters changed: the exported final policy differs from the initial model
    before, after = _weights(__import__("pathlib").Path(assets["model"])), _weights(run_dir / "global_step_2" / "actor" / "hf_model")
    changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
    assert changed, "no parameter changed after two GRPO steps"


PPO_CRITIC = {"algorithm.adv_estimator": "gae", "critic.model.path": None, "critic.ppo_micro_batch_size_per_gpu": 2,
              "critic.optim.lr": 1e-3, "actor_rollout_ref.actor.use_kl_loss": True}


ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")


def _ppo_critic(assets, run_dir, fsdp_size: int):
    sizes = {f"{role}.fsdp_config.fsdp_size": fsdp_size for role in ROLES}
    run(config(assets, run_dir, **{**PPO_CRITIC, "critic.model.path": assets["model"], **sizes}))
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def ppo_sharded(assets, tmp_path_factory, ray_session):
    """PPO with a critic and a reference model, every role sharded over the 2 ranks (FSDP2; the
    quickstart preset's own setting is fsdp_size=1)."""
    return _ppo_critic(assets, tmp_path_factory.mktemp("ppo"), fsdp_size=-1)


def test_ppo_with_critic_two_ranks(ppo_sharded):
    metrics = ppo_sharded
    last = metrics[2]
    assert all_finite(last)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/grad_norm", "timing_s/values"):
        assert key in last, key
    assert last["critic/grad_norm"] > 0


def test_local_backend_matches_ray(assets, tmp_path, ray_session):
    extra = {"trainer.n_cpu_workers": 1, "trainer.test_freq": -1, "trainer.val_before_train": False}
    run(config(assets, tmp_path / "ray", **extra))
    run(config(assets, tmp_path / "local", **{**extra, "trainer.backend": "local"}))
    ray_m, local_m = read_metrics(tmp_path / "ray"), read_metrics(tmp_path / "local")
    assert sorted(ray_m) == sorted(local_m) == [1, 2]
    for step in (1, 2):
        a, b = comparable(ray_m[step]), comparable(local_m[step])
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key, a[key], b[key])


def test_replicated_roles_match_sharded(assets, tmp_path, ppo_sharded):
    # fsdp_size=1: actor, reference and critic each a whole replica per rank, gradients summed once
    # a step (hybridrl.engine.replicate); the same steps as FSDP2's shards to float rounding
    replicated = _ppo_critic(assets, tmp_path / "replicated", fsdp_size=1)
    assert sorted(replicated) == sorted(ppo_sharded) == [0, 1, 2]
    for step in (1, 2):
        a, b = comparable(replicated[step]), comparable(ppo_sharded[step])
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key, a[key], b[key])


def test_next_generation_sent_with_the_update_changes_nothing(assets, tmp_path, ray_session, monkeypatch):
    """On Ray the next step's generation goes out behind the update and the weight sync (one round
    trip fewer for the driver to wait on), except on warm-up, checkpoint, validation and last
    steps. The ranks run the same calls in the same order, so a run resumed from its step-3
    checkpoint (which sends none early: its first two steps are its warm-up) repeats steps 4-6 of
    the run that sent steps 5 and 6 early, epochs included (the step's own prompts' epoch, though
    the next step's were drawn during it)."""
    import pyarrow.parquet as pq

    train8 = tmp_path / "train8.parquet"  # 2 steps an epoch: step 6's prompts, drawn in step 5, open one
    pq.write_table(pq.read_table(assets["train"]).slice(0, 8), train8)
    small = {**assets, "train": str(train8)}
    extra = {"trainer.total_training_steps": 6, "trainer.save_freq": 3, "trainer.test_freq": -1,
             "trainer.val_before_train": False}
    decisions: list[tuple[int, bool]] = []
    decide = PPOTrainer.sends_generation_early

    def spy(self):
        decisions.append((self.global_step, decide(self)))
        return decisions[-1][1]

    monkeypatch.setattr(PPOTrainer, "sends_generation_early", spy)
    run(config(small, tmp_path / "straight", **extra))
    assert decisions == [(1, False), (2, False), (3, False), (4, True), (5, True), (6, False)]
    decisions.clear()
    run(config(small, tmp_path / "resumed", **extra, **{
        "trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(tmp_path / "straight" / "global_step_3")}))
    assert decisions == [(4, False), (5, False), (6, False)]
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        a, b = comparable(straight[step]), comparable(resumed[step])
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (step, key, a[key], b[key])
    # the loader's epoch after drawing a step's batch (it names the next batch's): 2 after steps 4 and 5
    assert [straight[step]["training/epoch"] for step in (4, 5, 6)] == [2.0, 2.0, 3.0]


def test_verl_kernel_switches_give_the_usual_numbers(assets, tmp_path, monkeypatch):
    """A verl script's kernel switches run: use_fused_kernels (the actor's update, its old log-probs
    and the reference's from the hidden states), entropy chunking and checkpointing with an entropy
    bonus, and use_liger (a warning: it has no effect). Every logged metric matches the run without them."""
    import warnings

    from hybridrl.config import ConfigWarning

    extra = {"trainer.n_cpu_workers": 1, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "trainer.backend": "local", "actor_rollout_ref.actor.entropy_coeff": 0.01,
             "actor_rollout_ref.actor.ppo_epochs": 2}  # a second epoch: old log-probs are computed
    switches = {"actor_rollout_ref.model.use_fused_kernels": True,
                "actor_rollout_ref.actor.entropy_from_logits_with_chunking": True,
                "actor_rollout_ref.actor.entropy_checkpointing": True}
    run(config(assets, tmp_path / "usual", **extra))
    with pytest.warns(ConfigWarning, match="use_liger=True has no effect"):
        cfg = config(assets, tmp_path / "switched", **extra, **switches, **{"actor_rollout_ref.model.use_liger": True})
    from hybridrl.engine import fused_head

    calls, head_log_probs = [], fused_head.head_log_probs
    monkeypatch.setattr(fused_head, "head_log_probs", lambda *a, **k: calls.append(a[0].shape) or head_log_probs(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the tiny Qwen2 takes the fused path: no fallback warning
        run(cfg)
    # per step (8 rows, one rank): old and reference log-probs 2 micro-batches each, the update 2 epochs x 4
    assert len(calls) == 2 * (2 + 2 + 2 * 4), len(calls)
    usual, switched = read_metrics(tmp_path / "usual"), read_metrics(tmp_path / "switched")
    assert sorted(usual) == sorted(switched) == [1, 2]
    for step in (1, 2):
        a, b = comparable(usual[step]), comparable(switched[step])
        assert a.keys() == b.keys() and "actor/entropy" in a
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key, a[key], b[key])


def test_a_last_mini_batch_takes_the_prompts_left_over(assets, tmp_path, monkeypatch, ray_session):
    """verl's split: 3 prompts x 2 samples in mini-batches of 2 prompts are optimizer steps of 4 and
    2 sequences (in-process, where the steps can be watched), and on 2 sharded ranks of 2 and 1 rows
    each, which finish with finite metrics (the ranks agree on every call)."""
    from hybridrl.workers.actor import ActorWorker

    sizes = []
    step = ActorWorker._optimizer_step
    monkeypatch.setattr(ActorWorker, "_optimizer_step", lambda self, mini, s: sizes.append(len(mini)) or step(self, mini, s))
    extra = {"data.train_batch_size": 3, "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "trainer.test_freq": -1,
             "trainer.val_before_train": False, "actor_rollout_ref.actor.ppo_epochs": 2,
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1}
    run(config(assets, tmp_path / "local", **extra, **{"trainer.backend": "local", "trainer.n_cpu_workers": 1}))
    assert sizes == [4, 2, 4, 2] * 2  # 2 epochs a step, 2 steps
    run(config(assets, tmp_path / "ray", **extra))
    metrics = read_metrics(tmp_path / "ray")
    assert sorted(metrics) == [1, 2] and all(all_finite(metrics[s]) for s in (1, 2))


def test_a_reward_model_scores_the_responses(assets, tmp_path, monkeypatch, ray_session):
    """reward_model.enable=true: the reward model's output at each response's last token, after
    re-templating the prompt's chat and the decoded response with its own chat template, is the
    reward (in place of the rule scorer's), in training and validation; checked against the model
    run directly on the captured batch (in-process), and run on 2 sharded Ray ranks."""
    import torch
    from e2e_helpers import make_reward_model

    from hybridrl.models import load_reward_model, load_tokenizer
    from hybridrl.workers.reward_model import retemplate

    rm_dir = make_reward_model(tmp_path / "rm", assets["model"])
    scored = []
    score = PPOTrainer.score
    monkeypatch.setattr(PPOTrainer, "score", lambda self, batch, fn, m: scored.append(batch) or score(self, batch, fn, m))
    extra = {"reward_model.enable": True, "reward_model.model.path": str(rm_dir), "reward_model.micro_batch_size_per_gpu": 4,
             "data.return_raw_chat": True, "trainer.val_before_train": False}
    run(config(assets, tmp_path / "local", **extra, **{"trainer.backend": "local", "trainer.n_cpu_workers": 1}))
    assert len(scored) == 2
    model, tokenizer = load_reward_model(rm_dir), load_tokenizer(assets["model"])
    for batch in scored:
        rewritten = retemplate(batch, tokenizer, tokenizer, None)
        ids, mask = rewritten.batch["input_ids"], rewritten.batch["attention_mask"]
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        want = out.squeeze(-1)[torch.arange(len(ids)), mask.sum(-1) - 1]
        got = batch.batch["token_level_scores"]
        torch.testing.assert_close(got.sum(-1), want, rtol=0, atol=1e-5)
        lengths = batch.batch["attention_mask"][:, -got.shape[1]:].sum(-1)
        assert torch.equal(got.nonzero()[:, 1], (lengths - 1).clamp(min=0)[got.sum(-1) != 0])
    metrics = read_metrics(tmp_path / "local")
    assert metrics[2]["critic/score/mean"] != 0 and "val-core/hybridrl/addition/reward/mean@1" in metrics[2]
    run(config(assets, tmp_path / "ray", **extra))
    ray_metrics = read_metrics(tmp_path / "ray")
    assert sorted(ray_metrics) == [1, 2] and all(all_finite(ray_metrics[s]) for s in (1, 2))


def test_external_lib_registers_a_custom_architecture(assets, tmp_path, monkeypatch):
    """actor_rollout_ref.model.external_lib is imported in the workers before their models load (a
    module registering an architecture with transformers' Auto classes): a model of that type trains
    with it, and fails to load without it, naming the unknown type."""
    import json
    import shutil

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "hybridrl_test_arch.py").write_text(
        "from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM\n\n\n"
        "class RenamedConfig(Qwen2Config):\n    model_type = 'hybridrl_renamed_qwen2'\n\n\n"
        "class RenamedForCausalLM(Qwen2ForCausalLM):\n    config_class = RenamedConfig\n\n\n"
        "AutoConfig.register('hybridrl_renamed_qwen2', RenamedConfig)\n"
        "AutoModelForCausalLM.register(RenamedConfig, RenamedForCausalLM)\n")
    model_dir = tmp_path / "model"
    shutil.copytree(assets["model"], model_dir)
    config_json = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config_json, "model_type": "hybridrl_renamed_qwen2"}))
    monkeypatch.syspath_prepend(str(lib))
    extra = {"trainer.backend": "local", "trainer.n_cpu_workers": 1, "trainer.test_freq": -1,
             "trainer.val_before_train": False, "trainer.total_training_steps": 1,
             "actor_rollout_ref.model.path": str(model_dir)}
    with pytest.raises(Exception, match="hybridrl_renamed_qwen2"):
        run(config(assets, tmp_path / "without", **extra))
    run(config(assets, tmp_path / "with", **extra, **{"actor_rollout_ref.model.external_lib": "hybridrl_test_arch"}))
    assert all_finite(read_metrics(tmp_path / "with")[1])
    with pytest.raises(Exception, match="actor_rollout_ref.model.external_lib=no_such_module_here: cannot import"):
        run(config(assets, tmp_path / "missing", **extra, **{"actor_rollout_ref.model.external_lib": "no_such_module_here"}))


def test_val_only_validates_once_and_trains_nothing(assets, tmp_path):
    """trainer.val_only=true: one validation of the initial policy, logged at step 0, and no step."""
    extra = {"trainer.backend": "local", "trainer.n_cpu_workers": 1, "trainer.val_only": True,
             "trainer.val_before_train": False}
    out = run(config(assets, tmp_path / "val", **extra))
    metrics = read_metrics(tmp_path / "val")
    assert sorted(metrics) == [0] and "val-core/hybridrl/addition/reward/mean@1" in metrics[0]
    assert out == metrics[0] and not any(k.startswith("actor/") for k in metrics[0])
    assert not list((tmp_path / "val").glob("global_step_*"))  # nothing trained, nothing saved

"""The agent loop on the real native engine and tiny model: token in / token out across turns,
rollout log-probs equal to the trainer's recomputation, losses blind to tool / user tokens, and
the rollout worker switching to the agent loop from the config."""

import numpy as np
import pytest
import torch
from agent_helpers import make_prompts

from hybridrl import algos
from hybridrl.interactions import BaseInteraction
from hybridrl.models import load_causal_lm
from hybridrl.rollout.agent_loop import AgentLoop, AgentLoopConfig, TurnEncoder
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.native import NativeRolloutEngine

R = 64


class NagInteraction(BaseInteraction):
    """Never satisfied: the episode only ends at the turn cap or the budget."""

    def generate_response(self, instance_id, messages, **kwargs):
        return False, "Again, please.", 0.0, {}


class SpyEngine:
    """Records what the real engine was asked and what it sampled (composition, not a patch)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate_tensors(self, input_ids, attention_mask, position_ids, params):
        out = self.engine.generate_tensors(input_ids, attention_mask, position_ids, params)
        for row in range(input_ids.shape[0]):
            length = int(out["response_mask"][row].sum())
            self.calls.append((input_ids[row][attention_mask[row].bool()].tolist(),
                               out["responses"][row, :length].tolist()))
        return out


@pytest.fixture(scope="module")
def rollout(tokenizer, tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir))
    spy = SpyEngine(NativeRolloutEngine(model))
    loop = AgentLoop(spy, tokenizer, AgentLoopConfig(response_length=R, max_user_turns=2),
                     interactions={"nag": NagInteraction({"name": "nag"})})
    # many stop ids so the random model ends its turns after a few tokens
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=R, eos_token_id=2, pad_token_id=0, seed=7,
                            stop_token_ids=tuple(range(3, 400)))
    out = loop.generate(make_prompts(tokenizer, ["What is 2+3?", "Sort 3 1 2"], width=24), params)
    return model, spy, out


def test_stored_ids_are_the_sampled_ids_across_turns(rollout):
    """Every run of model tokens stored for training is exactly what one engine call sampled, given
    exactly the stored ids before it as its prompt (token in, token out, no re-tokenization)."""
    _, spy, out = rollout
    b = out.batch
    turns = out.non_tensor_batch["num_turns"].tolist()
    assert max(turns) == 6 and len(out) == 6  # 3 assistant + 2 user turns + 1, at least for some episodes
    calls: dict[tuple, list[list[int]]] = {}  # the n samples of a prompt share their first-turn prompt
    for inp, gen in spy.calls:
        calls.setdefault(tuple(inp), []).append(gen)
    runs = 0
    for f in range(len(out)):
        full = b["input_ids"][f][b["attention_mask"][f].bool()].tolist()
        prompt_len = int(b["attention_mask"][f, :24].sum())
        for start, end, value in segments(b["response_mask"][f].tolist()):
            if not value:
                continue
            prefix = tuple(full[: prompt_len + start])
            assert prefix in calls, f"row {f}: no engine call had the stored prefix of the run at {start}"
            stored = full[prompt_len + start: prompt_len + end]
            # the whole sampled turn, or its start when the budget R cut it
            assert any(stored == gen[: end - start] and (end - start == len(gen) or end == R) for gen in calls[prefix])
            runs += 1
    assert runs == len(spy.calls) > len(out)  # every call accounted for, several turns per episode


def segments(values):
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append((start, i, values[start]))
            start = i
    return runs


def test_mask_is_zero_exactly_on_user_tokens(rollout, tokenizer):
    _, _, out = rollout
    b = out.batch
    user_ids = TurnEncoder(tokenizer).encode([{"role": "user", "content": "Again, please."}])
    for row in range(len(out)):
        mask = b["response_mask"][row].tolist()
        real = int(b["attention_mask"][row, 24:].sum())
        model_runs = [seg for seg in segments(mask[:real]) if seg[2] == 1]
        user_turns = out.non_tensor_batch["num_turns"][row] - len(model_runs) - 1
        # between the model runs lie exactly the user turns' ids; nothing else has mask 0
        expected, ids = [], b["responses"][row].tolist()
        for start, end, value in segments(mask[:real]):
            if value == 0:
                assert ids[start:end] == user_ids
                expected.append((start, end))
        assert len(expected) == user_turns and mask[0] == 1 and mask[real - 1] == 1
        assert (b["rollout_log_probs"][row][torch.tensor(mask) == 0] == 0).all()


def test_rollout_log_probs_match_trainer_recomputation(rollout):
    model, _, out = rollout
    b = out.batch
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    log_probs = algos.log_probs_from_logits(logits[:, 23:-1], b["responses"])
    mask = b["response_mask"].bool()
    assert torch.allclose(log_probs[mask], b["rollout_log_probs"][mask], atol=2e-4)


def test_losses_and_advantages_ignore_user_tokens(rollout):
    _, _, out = rollout
    b = out.batch
    mask = b["response_mask"]
    scores = torch.zeros_like(b["rollout_log_probs"])
    scores[torch.arange(len(out)), (b["attention_mask"][:, 24:].sum(-1) - 1)] = torch.arange(len(out)).float()
    uid = np.array(["a"] * 3 + ["b"] * 3, dtype=object)
    adv, _ = algos.compute_advantage("grpo", token_level_rewards=scores, response_mask=mask, index=uid)
    assert (adv[mask == 0] == 0).all() and (adv[mask == 1] != 0).any()
    old = b["rollout_log_probs"]
    new = old + 0.05 * torch.randn_like(old)
    loss, _ = algos.compute_policy_loss("vanilla", old, new, adv, mask)
    noise = torch.randn_like(old) * (1 - mask)  # change only what sits on tool / user positions
    loss2, _ = algos.compute_policy_loss("vanilla", old + noise, new + noise * 3, adv, mask)
    assert torch.equal(loss, loss2)


def test_rollout_worker_uses_agent_loop_from_config(tmp_path, tiny_model_dir, tokenizer):
    from hybridrl.config import load_config
    from hybridrl.workers.rollout import RolloutWorker

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n")
    config = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "data.max_response_length=16",
                          "actor_rollout_ref.rollout.multi_turn.enable=true",
                          f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"],
                         preset="grpo_quickstart")
    worker = RolloutWorker(config)
    assert worker.agent_loop is not None and sorted(worker.agent_loop.tools.tools) == ["calculator"]
    prompts = make_prompts(tokenizer, ["What is 2+3?"], width=24)
    prompts.meta_info = {"global_step": 1}
    out = worker.generate_sequences(prompts)
    n = config.actor_rollout_ref.rollout.n
    assert out.batch["responses"].shape == (n, 16) and len(out.non_tensor_batch["num_turns"]) == n
    assert min(out.non_tensor_batch["num_turns"]) >= 2  # at least one assistant turn
    assert out.non_tensor_batch["extra_info"][0]["rollout_reward_scores"] == {"user_turn_rewards": [], "calculator": 0.0}

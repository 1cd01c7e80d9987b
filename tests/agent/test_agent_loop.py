"""The agent loop with a scripted engine: exact ids across turns, masks, tool failures, caps."""

import pytest
import torch
from agent_helpers import (
    AnswerTool,
    HangingTool,
    RaisingTool,
    ScriptedEngine,
    charwise,
    make_prompts,
    script_logprob,
)

from hybridrl.interactions import RetryFeedbackInteraction
from hybridrl.rollout.agent_loop import AgentLoop, AgentLoopConfig, TurnEncoder
from hybridrl.rollout.base import SamplingParams
from hybridrl.tools import CalculatorTool, ToolRegistry

EOS = 2
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*29"}}</tool_call>'


def params(n=1):
    return SamplingParams(n=n, temperature=1.0, max_new_tokens=8, eos_token_id=EOS, pad_token_id=0, seed=3)


def turn(tokenizer, text):
    return charwise(tokenizer, text) + [EOS]


def run(tokenizer, scripts, questions, tools=None, interactions=None, extra_infos=None, n=1, **cfg):
    engine = ScriptedEngine(tokenizer, scripts)
    loop = AgentLoop(engine, tokenizer, AgentLoopConfig(**{"response_length": 256, **cfg}), tools, interactions)
    out = loop.generate(make_prompts(tokenizer, questions, extra_infos=extra_infos), params(n))
    return out, engine


def segments(mask_row):
    """[(start, end, value)] runs of equal mask values."""
    runs, start = [], 0
    values = mask_row.tolist()
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append((start, i, values[start]))
            start = i
    return runs


def test_tool_turns_keep_generated_ids_and_mask_only_tool_tokens(tokenizer):
    call, answer = turn(tokenizer, CALL), turn(tokenizer, "<answer>10063</answer>")
    assert call[:-1] != tokenizer.encode(CALL, add_special_tokens=False)  # non-canonical: re-encoding would drift
    out, engine = run(tokenizer, {"Q1": [call, answer]}, ["Q1: what is 347*29?"],
                      tools=ToolRegistry([CalculatorTool()]), n=2)
    tool_ids = TurnEncoder(tokenizer).encode([{"role": "tool", "content": "10063"}])
    b = out.batch
    for row in range(2):
        used = len(call) + len(tool_ids) + len(answer)
        assert b["responses"][row, :used].tolist() == call + tool_ids + answer
        assert (b["responses"][row, used:] == 0).all()
        assert segments(b["response_mask"][row]) == [
            (0, len(call), 1), (len(call), len(call) + len(tool_ids), 0), (len(call) + len(tool_ids), used, 1),
            (used, 256, 0)]
        expected_lp = [script_logprob(t, p) for p, t in enumerate(call)] + [0.0] * len(tool_ids) + \
            [script_logprob(t, p) for p, t in enumerate(answer)]
        assert torch.allclose(b["rollout_log_probs"][row, :used], torch.tensor(expected_lp))
        assert (b["rollout_log_probs"][row, used:] == 0).all()
    # token in: the second call's prompt is exactly the first prompt + everything appended so far
    (first_in, _), (second_in, _) = engine.calls
    assert second_in[0] == first_in[0] + call + tool_ids
    assert "<|im_start|>tool\n10063<|im_end|>\n<|im_start|>assistant\n" in tokenizer.decode(tool_ids)
    attn, pos = b["attention_mask"], b["position_ids"]
    prompt_len = b["prompts"].shape[1]
    assert attn[:, prompt_len:].sum(-1).tolist() == [used, used]
    assert torch.equal(pos, (attn.cumsum(-1) - 1).clamp(min=0))
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    assert out.non_tensor_batch["num_turns"].tolist() == [4, 4]  # 2 assistant + 1 tool + 1 (verl's count)
    assert out.non_tensor_batch["tool_call_counts"].tolist() == [1, 1]
    assert out.non_tensor_batch["extra_info"][0]["num_turns"] == 4


def test_raising_hanging_and_malformed_tools_return_errors_and_episode_continues(tokenizer):
    HangingTool.gate.clear()
    tools = ToolRegistry([RaisingTool(), HangingTool(config={"timeout_s": 0.3}), CalculatorTool()])
    script = [turn(tokenizer, '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'),
              turn(tokenizer, '<tool_call>{"name": "sleepy", "arguments": {}}</tool_call>'),
              turn(tokenizer, "<tool_call>{oops}</tool_call>"),
              turn(tokenizer, "<answer>1</answer>")]
    try:
        out, engine = run(tokenizer, {"Q2": script}, ["Q2"], tools=tools, response_length=512)
    finally:
        HangingTool.gate.set()
    text = tokenizer.decode(out.batch["responses"][0][out.batch["attention_mask"][0, 48:].bool()])
    assert "Error: RuntimeError: kaboom" in text
    assert "Error: tool 'sleepy' timed out after 0.3 s" in text
    assert "Error: the tool call is not valid JSON" in text
    assert text.rstrip().endswith("<answer>1</answer><|im_end|>")
    assert len(engine.calls) == 4
    assert out.non_tensor_batch["num_turns"].tolist() == [8]
    assert out.non_tensor_batch["tool_call_counts"].tolist() == [2]  # the malformed one was never run


def test_tool_rewards_and_kwargs_reach_extra_info(tokenizer):
    tool = AnswerTool()
    infos = [{"index": i, "tools_kwargs": {"submit": {"create_kwargs": {"ground_truth": str(i)}}}} for i in range(2)]
    script = [turn(tokenizer, '<tool_call>{"name": "submit", "arguments": {"answer": "1"}}</tool_call>'),
              turn(tokenizer, "done")]
    out, _ = run(tokenizer, {"Q": script}, ["Q a", "Q b"], tools=ToolRegistry([tool]), extra_infos=infos)
    scores = [info["rollout_reward_scores"] for info in out.non_tensor_batch["extra_info"]]
    assert scores == [{"user_turn_rewards": [], "submit": 0.0}, {"user_turn_rewards": [], "submit": 1.0}]
    assert len(tool.released) == 2 and not tool.state.keys() - set(tool.released)


def test_budget_and_turn_caps_end_episodes_on_model_tokens(tokenizer):
    call = turn(tokenizer, CALL)
    tools = ToolRegistry([CalculatorTool()])
    # the tool turn would not leave room for an answer: the episode ends after the call
    out, engine = run(tokenizer, {"Q": [call]}, ["Q"], tools=tools, response_length=len(call) + 5)
    assert out.batch["response_mask"][0].sum() == len(call) and len(engine.calls) == 1
    # a turn that hits the budget without EOS ends the episode ("length")
    out, _ = run(tokenizer, {"Q": [call]}, ["Q"], tools=tools, response_length=10)
    assert out.batch["response_mask"][0].tolist() == [1] * 10
    assert out.non_tensor_batch["tool_call_counts"].tolist() == [0]
    # a model that always calls the tool stops at max_assistant_turns
    out, engine = run(tokenizer, {"Q": [call]}, ["Q"], tools=tools, max_assistant_turns=3)
    assert len(engine.calls) == 3 and out.non_tensor_batch["tool_call_counts"].tolist() == [2]
    out, engine = run(tokenizer, {"Q": [call]}, ["Q"], tools=tools, max_user_turns=1)
    assert len(engine.calls) == 2 and out.non_tensor_batch["num_turns"].tolist() == [4]


def test_interaction_retry_gives_user_turn_with_zero_mask_and_rewards(tokenizer):
    teacher = RetryFeedbackInteraction({"name": "teacher", "max_retries": 1})
    script = [turn(tokenizer, "<answer>13</answer>"), turn(tokenizer, "<answer>12</answer>")]
    infos = [{"interaction_kwargs": {"name": "teacher", "ground_truth": "12"}}]
    out, engine = run(tokenizer, {"Q": script}, ["Q"], interactions={"teacher": teacher}, extra_infos=infos)
    user_ids = TurnEncoder(tokenizer).encode(
        [{"role": "user", "content": "Your answer 13 is wrong. Check your work and try again."}])
    first, second = script
    row = out.batch["responses"][0].tolist()
    assert row[: len(first) + len(user_ids) + len(second)] == first + user_ids + second
    assert segments(out.batch["response_mask"][0])[:3] == [
        (0, len(first), 1), (len(first), len(first) + len(user_ids), 0),
        (len(first) + len(user_ids), len(first) + len(user_ids) + len(second), 1)]
    assert out.non_tensor_batch["extra_info"][0]["rollout_reward_scores"]["user_turn_rewards"] == [0.0, 1.0]
    assert len(engine.calls) == 2 and not teacher._state  # finalized


def test_config_validation():
    with pytest.raises(ValueError, match="allowed"):
        AgentLoopConfig(response_length=8, format="xml")
    with pytest.raises(ValueError, match="max_assistant_turns"):
        AgentLoopConfig(response_length=8, max_assistant_turns=0)


def test_bad_tools_kwargs_name_the_row(tokenizer):
    infos = [{"index": 0}, {"index": 41, "tools_kwargs": {"weather": {}}}]
    with pytest.raises(ValueError, match=r"prompt row 1 \(extra_info index 41\).*'weather'"):
        run(tokenizer, {"Q": [turn(tokenizer, "x")]}, ["Q a", "Q b"], tools=ToolRegistry([CalculatorTool()]),
            extra_infos=infos)

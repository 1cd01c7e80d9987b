"""RewardManager on real tokenized responses: placement, dict returns, custom functions loaded by
path in spawned workers, and failures (raise, hang, NaN, wrong type) under both on_error policies."""

import textwrap

import pytest
import torch

from hybridrl.models.tiny_tokenizer import build_tiny_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.rewards import (
    OverlongBuffer,
    RewardFunctionError,
    RewardManager,
    load_reward_function,
)
from hybridrl.rewards.manager import response_lengths

R = 8  # response length


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def make_batch(tokenizer, responses, truths, source="hybridrl/addition", prompt_len=3):
    """DataProto with left-padded dummy prompts and right-padded responses (+ EOS) of length R."""
    rows, masks = [], []
    for text in responses:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = ids[:R]
        rows.append(ids + [tokenizer.pad_token_id] * (R - len(ids)))
        masks.append([1] * len(ids) + [0] * (R - len(ids)))
    responses_t, resp_mask = torch.tensor(rows), torch.tensor(masks)
    prompts = torch.full((len(rows), prompt_len), 5)
    attention = torch.cat([torch.ones(len(rows), prompt_len, dtype=torch.long), resp_mask], dim=1)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses_t,
            "input_ids": torch.cat([prompts, responses_t], dim=1),
            "attention_mask": attention,
            "response_mask": resp_mask,
        },
        non_tensors={
            "data_source": [source] * len(rows),
            "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
            "extra_info": [{"index": i, "delay": 0} for i in range(len(rows))],
        },
    )


def write_reward_file(tmp_path, body):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_scores_on_last_valid_token(tokenizer):
    data = make_batch(tokenizer, ["357", "12", "4"], ["357", "13", "4"])
    scores, extra = RewardManager(tokenizer)(data)
    lengths = data.batch["response_mask"].sum(-1)
    assert scores.dtype == torch.float32 and scores.shape == (3, R)
    expected = torch.zeros(3, R)
    for i, (n, s) in enumerate(zip(lengths.tolist(), [1.0, 0.0, 1.0])):
        expected[i, n - 1] = s  # the EOS is the last valid token; the decoded text skips it
    assert torch.equal(scores, expected)
    assert extra["reward_extra_info"]["score"] == [1.0, 0.0, 1.0]
    assert extra["metrics"]["reward/errors"] == 0.0 and extra["metrics"]["reward/timeouts"] == 0.0


def test_truncated_response_without_eos(tokenizer):
    data = make_batch(tokenizer, ["1234567890123"], ["1234567"])  # 13 digits > R: cut at R, no EOS
    scores, _ = RewardManager(tokenizer, reward_kwargs={"method": "flexible"})(data)
    assert data.batch["response_mask"].sum() == R
    assert scores[0, R - 1] == 0.0 and scores.abs().sum() == 0.0  # decoded "12345678" != "1234567"


def test_custom_function_dict_return_in_workers(tokenizer, tmp_path):
    path = write_reward_file(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
            return {"score": float(solution_str == ground_truth) + bonus, "length": len(solution_str)}
        """,
    )
    fn = load_reward_function(path, "compute_score", reward_kwargs={"bonus": 0.5})
    data = make_batch(tokenizer, ["357", "12"], ["357", "13"])
    with RewardManager(tokenizer, compute_score=fn, num_workers=2, timeout_s=30) as manager:
        for _ in range(2):  # the pool is reused across calls
            scores, extra = manager(data)
            assert scores.sum(-1).tolist() == [1.5, 0.5]
            assert extra["reward_extra_info"]["length"] == [3, 2]
            assert extra["metrics"]["reward/length/mean"] == 2.5


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_reward_function(tmp_path / "missing.py")
    path = write_reward_file(tmp_path, "def other(**kw):\n    return 1.0\n")
    with pytest.raises(AttributeError, match=r"'compute_score' is not a function.*\['other'\]"):
        load_reward_function(path)


FAILING = """
import math, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    kind = ground_truth
    if kind == "raise":
        raise ZeroDivisionError("boom in my reward")
    if kind == "sleep":
        time.sleep(60)
    if kind == "nan":
        return math.nan
    if kind == "str":
        return "1.0"
    if kind == "nodict":
        return {"acc": 1.0}
    return 1.0
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_on_error_zero_counts_failures(tokenizer, tmp_path, num_workers):
    fn = load_reward_function(write_reward_file(tmp_path, FAILING))
    kinds = ["ok", "raise", "nan", "str", "nodict", "ok"] + (["sleep"] if num_workers else [])
    data = make_batch(tokenizer, ["1"] * len(kinds), kinds)
    with RewardManager(tokenizer, fn, num_workers=num_workers, timeout_s=2.0, on_error="zero") as manager:
        scores, extra = manager(data)
        assert scores.sum(-1).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0] + ([0.0] if num_workers else [])
        assert extra["metrics"]["reward/errors"] == 4.0
        assert extra["metrics"]["reward/timeouts"] == (1.0 if num_workers else 0.0)
        messages = {e["index"]: e["error"] for e in extra["errors"]}
        assert "ZeroDivisionError: boom in my reward" in messages[1]
        assert "non-finite" in messages[2] and "str" in messages[3] and "'score'" in messages[4]
        if num_workers:
            assert "timed out" in messages[6]
            scores, extra = manager(data[:1])  # the killed worker was replaced: the pool still works
            assert scores.sum().item() == 1.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind, match", [("raise", "boom in my reward"), ("sleep", "timed out"), ("nan", "nan")])
def test_on_error_fail_raises_with_sample(tokenizer, tmp_path, kind, match):
    fn = load_reward_function(write_reward_file(tmp_path, FAILING))
    data = make_batch(tokenizer, ["1", "1"], ["ok", kind], source="my/source")
    with RewardManager(tokenizer, fn, num_workers=1, timeout_s=2.0, on_error="fail") as manager:
        with pytest.raises(RewardFunctionError, match=match) as info:
            manager(data)
    err = info.value
    assert err.index == 1 and err.data_source == "my/source"
    assert "sample 1 (data_source='my/source')" in str(err)
    if kind == "raise":
        assert "Traceback" in str(err) and "my_reward.py" in str(err)


def test_worker_crash_is_reported(tokenizer, tmp_path):
    path = write_reward_file(
        tmp_path, "import os\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    os._exit(3)\n"
    )
    data = make_batch(tokenizer, ["1"], ["x"])
    with RewardManager(tokenizer, load_reward_function(path), num_workers=1, on_error="zero") as manager:
        scores, extra = manager(data)
    assert extra["metrics"]["reward/errors"] == 1.0 and "exit code 3" in extra["errors"][0]["error"]


def test_overlong_penalty(tokenizer):
    buffer = OverlongBuffer(length=4, penalty_factor=1.0, max_response_length=R)
    # expected = 8 - 4 = 4 tokens free; then -(L - 4) / 4: lengths 2, 5, 8 -> 0, -0.25, -1
    data = make_batch(tokenizer, ["1", "1234", "1234567890"], ["1", "1", "1"])
    assert response_lengths(data).tolist() == [2, 5, 8]
    scores, extra = RewardManager(tokenizer, overlong_buffer=buffer)(data)
    assert scores.sum(-1).tolist() == [1.0, -0.25, -1.0]
    data = make_batch(tokenizer, ["1", "1234567890"], ["1", "1"])
    scores, extra = RewardManager(tokenizer, overlong_buffer=buffer, reward_kwargs={"method": "flexible"})(data)
    assert scores.sum(-1).tolist() == [1.0, -1.0]  # "1"+EOS = 2 tokens; the second is cut at R = 8
    assert extra["reward_extra_info"]["overlong"] == [False, True]
    assert extra["metrics"]["reward/overlong_ratio"] == 0.5
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        OverlongBuffer(length=0, penalty_factor=1.0, max_response_length=8)


def test_bad_arguments_and_missing_columns(tokenizer):
    with pytest.raises(ValueError, match="on_error"):
        RewardManager(tokenizer, on_error="ignore")
    data = make_batch(tokenizer, ["1"], ["1"])
    data.non_tensor_batch["reward_model"][0] = {"style": "rule"}
    with pytest.raises(ValueError, match="sample 0: reward_model must be a dict with 'ground_truth'"):
        RewardManager(tokenizer)(data)


def test_close_stops_worker_processes(tokenizer):
    manager = RewardManager(tokenizer, num_workers=2)
    scores, _ = manager(make_batch(tokenizer, ["1", "2"], ["1", "1"]))
    assert scores.sum(-1).tolist() == [1.0, 0.0]
    processes = [w.process for w in manager._pool._workers]
    assert len(processes) == 2 and all(p.is_alive() for p in processes)
    manager.close()
    assert not any(p.is_alive() for p in processes)


def test_response_lengths_from_either_mask_and_reward_fn_key(tokenizer):
    data = make_batch(tokenizer, ["12", "", "1234567890"], ["12", "", "1"])
    assert response_lengths(data).tolist() == [3, 1, 8]
    only_response_mask = data.select(batch_keys=["responses", "response_mask"],
                                     non_tensor_batch_keys=["data_source", "reward_model"])
    assert response_lengths(only_response_mask).tolist() == [3, 1, 8]
    data.non_tensor_batch["task"] = data.non_tensor_batch.pop("data_source")
    scores, _ = RewardManager(tokenizer, reward_fn_key="task")(data)
    assert scores.sum(-1).tolist() == [1.0, 1.0, 0.0]  # "" scores 1.0 against "" on the EOS at index 0
    assert scores[1, 0] == 1.0


BATCHED = """
calls = []


def compute_score(data_sources, solution_strs, ground_truths, extra_infos=None, bonus=0.0):
    calls.append(len(solution_strs))
    out = []
    for source, text, truth, info in zip(data_sources, solution_strs, ground_truths, extra_infos):
        out.append({"score": float(text == truth) + bonus, "row": info["index"], "calls": len(calls)})
    return out


def too_few(data_sources, solution_strs, ground_truths, extra_infos=None):
    return [1.0] * (len(solution_strs) - 1)


def raises(data_sources, solution_strs, ground_truths, extra_infos=None):
    raise RuntimeError("batch boom")
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_batched_function_is_called_once_per_batch_with_lists(tokenizer, tmp_path, num_workers):
    # verl's reward_manager=batch: one call, the rows' lists in order, one result per row
    fn = load_reward_function(write_reward_file(tmp_path, BATCHED), "compute_score", reward_kwargs={"bonus": 0.5})
    data = make_batch(tokenizer, ["357", "12", "4"], ["357", "13", "4"])
    with RewardManager(tokenizer, fn, num_workers=num_workers, batched=True) as manager:
        scores, extra = manager(data)
    lengths = data.batch["response_mask"].sum(-1)
    assert [scores[i, n - 1].item() for i, n in enumerate(lengths.tolist())] == [1.5, 0.5, 1.5]
    assert extra["reward_extra_info"]["row"] == [0, 1, 2]
    assert extra["reward_extra_info"]["calls"] == [1, 1, 1]  # a single call scored all three


@pytest.mark.parametrize("name, match", [("too_few", "must return a list of 2 results"), ("raises", "batch boom")])
def test_batched_function_failures_fail_every_row(tokenizer, tmp_path, name, match):
    fn = load_reward_function(write_reward_file(tmp_path, BATCHED), name)
    data = make_batch(tokenizer, ["1", "2"], ["1", "2"])
    scores, extra = RewardManager(tokenizer, fn, batched=True, on_error="zero")(data)
    assert scores.abs().sum() == 0.0 and extra["metrics"]["reward/errors"] == 2.0
    assert all(match in e["error"] for e in extra["errors"])
    with pytest.raises(RewardFunctionError, match=match):
        RewardManager(tokenizer, fn, batched=True)(data)


def test_reward_manager_batch_key_reaches_the_trainers_manager(tokenizer, tmp_path):
    from hybridrl.config import load_config
    from hybridrl.trainer.main_ppo import build_reward_manager

    path = write_reward_file(tmp_path, BATCHED)
    cfg = load_config(["reward_model.reward_manager=batch", f"custom_reward_function.path={path}",
                       "custom_reward_function.name=compute_score"], preset="grpo_quickstart")
    manager = build_reward_manager(cfg, tokenizer)
    scores, extra = manager(make_batch(tokenizer, ["357", "12"], ["357", "13"]))
    assert manager.batched and extra["reward_extra_info"]["calls"] == [1, 1]
    assert scores.sum(-1).tolist() == [1.0, 0.0]
    assert not build_reward_manager(load_config([], preset="grpo_quickstart"), tokenizer).batched

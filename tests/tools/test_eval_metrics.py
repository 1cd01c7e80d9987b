"""Eval scoring per data source and mean@N / maj@N / best@N on constructed responses."""

from __future__ import annotations

import pytest

from hybridrl.trainer.eval_metrics import (
    SampleRecord,
    aggregate,
    format_table,
    majority_score,
    score_response,
)

GSM = "openai/gsm8k"
MATH = "HuggingFaceH4/MATH-500"


def test_gsm8k_strict_lenient_and_format():
    strict = score_response(GSM, "so 3 + 4 = 7\n#### 7", "7")
    assert (strict.strict, strict.lenient, strict.formatted, strict.strict_answer) == (1.0, 1.0, True, "7")
    lenient = score_response(GSM, "The answer is 1,234.", "1234")
    assert (lenient.strict, lenient.lenient, lenient.formatted) == (0.0, 1.0, False)
    assert lenient.strict_answer is None and lenient.lenient_answer == "1234"
    wrong = score_response(GSM, "#### 8 then 7", "8")  # strict reads the #### answer, lenient the last number
    assert (wrong.strict, wrong.lenient) == (1.0, 0.0)


def test_math_boxed_strict_and_number_fallback():
    boxed = score_response(MATH, r"thus \boxed{\frac{1}{2}}", "0.5")
    assert (boxed.strict, boxed.lenient, boxed.formatted) == (1.0, 1.0, True)
    plain = score_response(MATH, "the result is 12", "12")
    assert (plain.strict, plain.lenient, plain.formatted) == (0.0, 1.0, False)
    # both spellings vote for one normalised answer
    assert score_response(MATH, r"\boxed{0.5}", "1/2").strict_answer == boxed.strict_answer


def test_synthetic_and_countdown():
    add = score_response("hybridrl/addition", "sum: 42", "42")
    assert (add.strict, add.lenient, add.formatted) == (0.0, 1.0, None)
    assert score_response("hybridrl/addition", " 42 ", "42").strict == 1.0
    truth = {"target": 10, "numbers": [2, 5]}
    assert score_response("countdown", "<answer>2*5</answer>", truth).strict == 1.0
    wrong = score_response("countdown", "<answer>2+5</answer>", truth)
    assert (wrong.strict, wrong.formatted) == (0.0, True)  # accuracy, not the 0.1 training format score


def test_custom_function_and_unknown_source():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(len(solution_str) == extra_info["n"]), "acc": 1}

    got = score_response("mine", "abc", "x", {"n": 3}, custom_fn=fn)
    assert (got.strict, got.lenient) == (1.0, 1.0)
    with pytest.raises(NotImplementedError, match="--reward-function"):
        score_response("mine", "abc", "x")


def test_majority_vote_rules():
    assert majority_score(["a", "b", "b", None], [0.0, 1.0, 1.0, 0.0]) == 1.0
    assert majority_score(["a", "b", "b", "a"], [0.3, 1.0, 1.0, 0.3]) == 0.3  # tie: first seen
    assert majority_score([None, None], [1.0, 1.0]) == 0.0


def _records(source: str, prompt_id: int, responses: list[str], truth: str, lengths=None, clipped=None):
    lengths = lengths or [5] * len(responses)
    clipped = clipped or [False] * len(responses)
    return [SampleRecord(prompt_id, source, score_response(source, text, truth), n, c)
            for text, n, c in zip(responses, lengths, clipped)]


def test_aggregate_mean_maj_best_per_source():
    n = 4
    records = (
        # prompt 0: 1 of 4 right, majority wrong (answer 5)
        _records(GSM, 0, ["#### 7", "#### 5", "#### 5", "no answer"], "7", lengths=[4, 4, 4, 8], clipped=[0, 0, 0, 1])
        # prompt 1: 3 of 4 right (one only leniently), majority right
        + _records(GSM, 1, ["#### 3", "#### 3", "it is 3", "#### 2"], "3")
        + _records("hybridrl/addition", 2, ["12", "12", "13", " 12"], "12")
    )
    out = aggregate(records, n)
    gsm = out[GSM]
    assert gsm["prompts"] == 2 and gsm["samples"] == 8
    assert gsm["strict/mean@4"] == pytest.approx((1 + 2) / 8)
    assert gsm["strict/best@4"] == 1.0
    assert gsm["strict/maj@4"] == pytest.approx(0.5)  # prompt 0 votes 5 (wrong), prompt 1 votes 3
    assert gsm["lenient/mean@4"] == pytest.approx((1 + 3) / 8)
    assert gsm["format/mean@4"] == pytest.approx(6 / 8)
    assert gsm["response_length/mean"] == pytest.approx((4 * 3 + 8 + 5 * 4) / 8)
    assert gsm["response_length/clip_ratio"] == pytest.approx(1 / 8)
    add = out["hybridrl/addition"]
    assert add["strict/mean@4"] == 0.75 and add["strict/maj@4"] == 1.0 and "format/mean@4" not in add
    assert out["all"]["prompts"] == 3
    assert out["all"]["strict/best@4"] == 1.0
    assert out["all"]["strict/mean@4"] == pytest.approx((3 + 3) / 12)
    table = format_table(out)
    assert table.splitlines()[0].split() == ["metric", "hybridrl/addition", GSM, "all"]  # sources sorted, all last
    assert "strict/maj@4" in table

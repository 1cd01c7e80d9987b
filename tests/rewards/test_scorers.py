"""Scorers: gsm8k (verl's strict/flexible rules, on the real GSM8K files), MATH boxed, countdown,
synthetic tasks and the data_source router."""

import json
from pathlib import Path

import pytest

from hybridrl.rewards import countdown, default_compute_score, gsm8k, math_answer, synthetic

GSM8K_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k"


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so the answer is\n#### 72", "72", 1.0),
        ("#### 1,000", "1000", 1.0),  # commas stripped
        ("#### $1,000", "1000", 0.0),  # "$" before the number does not match "#### (number)": verl's regex
        ("#### 1000$", "1000", 1.0),  # a "$" after the number is outside the match
        ("#### -3", "-3", 1.0),  # negatives
        ("#### 0.5", "0.5", 1.0),  # decimals compared as strings
        ("#### 0.50", "0.5", 0.0),  # ... exactly
        ("#### 3\nwait, no\n#### 4", "4", 1.0),  # the LAST #### answer counts
        ("#### 3\nwait, no\n#### 4", "3", 0.0),
        ("The answer is 72.", "72", 0.0),  # no #### answer
        ("####72", "72", 0.0),  # verl needs exactly one space after ####
        ("#### 71", "72", 0.0),  # wrong answer, format_score default 0
        ("#### 72" + " filler" * 60, "72", 0.0),  # answer beyond the last 300 characters
        ("x" * 1000 + "#### 72", "72", 1.0),  # long response, answer inside the tail
    ],
)
def test_gsm8k_strict_table(response, truth, expected):
    assert gsm8k.compute_score(response, truth) == expected


def test_gsm8k_format_score_and_flexible():
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0
    assert gsm8k.compute_score("I think it is 72.", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("it costs $1,200.", "1200", method="flexible") == 1.0
    assert gsm8k.extract_solution("nothing here", method="flexible") is None
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 1", "1", method="lenient")


def _gsm8k_lines(split):
    path = GSM8K_DIR / f"{split}.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent (shared data only exists on the development machine)")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("split, count", [("train", 7473), ("test", 1319)])
def test_gsm8k_gold_answers_score_one(split, count):
    """Every gold answer scores 1.0, both as '#### <answer>' and as the full reference solution."""
    from hybridrl.data.preprocess import gsm8k_answer

    lines = _gsm8k_lines(split)
    assert len(lines) == count
    for i, row in enumerate(lines):
        truth = gsm8k_answer(row["answer"], f"row {i}")
        assert default_compute_score("openai/gsm8k", f"#### {truth}", truth) == 1.0, (i, truth)
        assert default_compute_score("openai/gsm8k", row["answer"], truth) == 1.0, (i, row["answer"][-80:])
        wrong = str(int(float(truth)) + 1)
        assert default_compute_score("openai/gsm8k", f"#### {wrong}", truth) == 0.0


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1/2}", "\\dfrac{1}{2}", 1.0),
        ("\\boxed{2.50}", "2.5", 1.0),  # numeric fallback
        ("\\boxed{10\\%}", "10", 1.0),
        ("\\boxed{5 \\text{ cm}}", "5", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("first \\boxed{1} then \\boxed{2}", "2", 1.0),  # the last box counts
        ("first \\boxed{1} then \\boxed{2}", "1", 0.0),
        ("\\fbox{7}", "7", 1.0),
        ("\\boxed 7$", "7", 1.0),
        ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
        ("\\boxed{3", "3", 0.0),  # unclosed brace: truncated answer
        ("the answer is 3", "3", 0.0),  # no box
        ("\\boxed{4}", "3", 0.0),
        ("\\boxed{1,000}", "1000", 1.0),
    ],
)
def test_math_boxed_table(response, truth, expected):
    assert math_answer.compute_score(response, truth) == expected
    assert default_compute_score("HuggingFaceH4/MATH-500", response, truth) == expected


def test_math_helpers():
    assert math_answer.last_boxed_only_string("a \\boxed{\\frac{a}{b}} c") == "\\boxed{\\frac{a}{b}}"
    assert math_answer.remove_boxed("\\boxed{x^{2}}") == "x^{2}"
    with pytest.raises(ValueError, match="not a boxed"):
        math_answer.remove_boxed("{x}")


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>...</think> <answer>(44 + 19) + 35</answer>", 1.0),
        ("<answer> 35 + 44 + 19 </answer>", 1.0),
        ("<answer>1 + 2</answer> no wait <answer>44 + 19 + 35</answer>", 1.0),  # last answer counts
        ("<answer>44 + 19</answer>", 0.1),  # a number unused
        ("<answer>44 + 44 + 10</answer>", 0.1),  # wrong numbers
        ("<answer>44 + 19 - 35</answer>", 0.1),  # wrong value
        ("<answer>__import__('os')</answer>", 0.1),  # not arithmetic: never evaluated
        ("<answer>44 / (19 - 19) + 35</answer>", 0.1),  # division by zero, wrong numbers
        ("44 + 19 + 35", 0.0),  # no answer tags
    ],
)
def test_countdown_table(response, expected):
    truth = {"target": 98, "numbers": [44, 19, 35]}
    assert countdown.compute_score(response, truth) == expected
    assert default_compute_score("countdown", response, truth) == expected


def test_countdown_division_and_bad_ground_truth():
    assert countdown.compute_score("<answer>(6 / 3) * 5</answer>", {"target": 10, "numbers": [3, 5, 6]}) == 1.0
    assert countdown.evaluate_equation("2 ** 100") is None
    with pytest.raises(ValueError, match="target"):
        countdown.compute_score("<answer>1</answer>", "98")


@pytest.mark.parametrize(
    "source, response, truth, strict, flexible",
    [
        ("hybridrl/addition", "357", "357", 1.0, 1.0),
        ("hybridrl/addition", " 357\n", "357", 1.0, 1.0),
        ("hybridrl/addition", "the sum is 357", "357", 0.0, 1.0),
        ("hybridrl/addition", "358", "357", 0.0, 0.0),
        ("hybridrl/reverse", "4321", "4321", 1.0, 1.0),
        ("hybridrl/reverse", "reversed: 4321", "4321", 0.0, 1.0),
        ("hybridrl/reverse", "1234", "4321", 0.0, 0.0),
        ("hybridrl/sort", "1 2 9", "1 2 9", 1.0, 1.0),
        ("hybridrl/sort", "sorted: 1, 2, 9", "1 2 9", 0.0, 1.0),
        ("hybridrl/sort", "1 9 2", "1 2 9", 0.0, 0.0),
        ("hybridrl/sort", "", "1 2 9", 0.0, 0.0),
    ],
)
def test_synthetic_table(source, response, truth, strict, flexible):
    assert default_compute_score(source, response, truth) == strict
    assert default_compute_score(source, response, truth, method="flexible") == flexible


def test_router_unknown_source_names_known_ones():
    with pytest.raises(NotImplementedError, match="openai/gsm8k"):
        default_compute_score("my/dataset", "x", "y")
    assert synthetic.addition_score("7", "7") == 1.0

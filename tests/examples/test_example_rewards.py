"""The reward functions of the worked examples (examples/*/reward.py), loaded the way main_ppo loads
them (custom_reward_function.path), on responses whose scores are known."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.rewards.loader import load_reward_function

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def reward(example: str):
    return load_reward_function(EXAMPLES / example / "reward.py", "compute_score")


@pytest.mark.parametrize("response, expected", [
    ("108", {"score": 1.0, "acc": 1.0, "strict": 1.0, "bare": 1.0}),
    ("54 + 54 = 108", {"score": 1.0, "acc": 1.0, "strict": 0.0, "bare": 0.0}),
    ("54 + 54 = 16", {"score": 0.0, "acc": 0.0, "strict": 0.0, "bare": 0.0}),
    (" 107\n", {"score": 0.0, "acc": 0.0, "strict": 0.0, "bare": 1.0}),
    ("The sum is 108, I think 2 times", {"score": 0.0, "acc": 0.0, "strict": 0.0, "bare": 0.0}),
])
def test_smollm2_arithmetic_reward(response, expected):
    assert reward("smollm2_arithmetic")("hybridrl/addition", response, "108") == expected


@pytest.mark.parametrize("response, expected", [
    ("She has 3 + 4 = 7 apples.\n#### 7", {"score": 1.0, "acc": 1.0, "lenient": 1.0, "format": 1.0}),
    ("She has 3 + 4 = 8 apples.\n#### 8", {"score": 0.1, "acc": 0.0, "lenient": 0.0, "format": 1.0}),
    ("So the answer is 7.", {"score": 0.0, "acc": 0.0, "lenient": 1.0, "format": 0.0}),
    ("I do not know", {"score": 0.0, "acc": 0.0, "lenient": 0.0, "format": 0.0}),
])
def test_smollm2_gsm8k_reward(response, expected):
    assert reward("smollm2_gsm8k")("openai/gsm8k", response, "7") == expected

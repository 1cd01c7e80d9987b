"""Reward of the SmolLM2 arithmetic example (verl's signature).

The prompt asks for "only the number". ``score`` and ``acc`` are 1 when the last integer of the
response is the right sum (``hybridrl.rewards.synthetic.addition_score``, flexible): the model is
rewarded for getting the arithmetic right. ``strict`` additionally requires the response to be
exactly the number, and ``bare`` reports whether it was only a number (right or wrong).
"""

from __future__ import annotations

import re

from hybridrl.rewards.synthetic import addition_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    acc = addition_score(solution_str, ground_truth, method="flexible")
    return {"score": acc, "acc": acc, "strict": addition_score(solution_str, ground_truth, method="strict"),
            "bare": float(re.fullmatch(r"\s*-?\d+\s*", solution_str) is not None)}

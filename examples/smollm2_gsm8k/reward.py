"""Reward of the SmolLM2 GSM8K example: verl's strict ``####`` GSM8K reward, reported three ways.

``score`` is ``hybridrl.rewards.gsm8k.compute_score`` with ``method="strict"`` (the last
``#### <number>`` must equal the answer) and verl's ``format_score`` argument: a response with a
well-formed ``#### <number>`` but the wrong number earns ``format_score`` (0.1 here, 0.0 in verl's
default), so a 135M model that almost never answers right still gets a signal to use the format.
``acc`` is the strict score proper (right number after ``####``), ``lenient`` the last number in
the response, ``format`` whether a ``#### <number>`` is there at all.
"""

from __future__ import annotations

from hybridrl.rewards.gsm8k import compute_score as gsm8k_score
from hybridrl.rewards.gsm8k import extract_solution

FORMAT_SCORE = 0.1


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    return {
        "score": gsm8k_score(solution_str, ground_truth, method="strict", format_score=FORMAT_SCORE),
        "acc": gsm8k_score(solution_str, ground_truth, method="strict"),
        "lenient": gsm8k_score(solution_str, ground_truth, method="flexible"),
        "format": float(extract_solution(solution_str, method="strict") is not None),
    }

"""Scoring for the built-in synthetic tasks (``hybridrl/addition``, ``hybridrl/reverse``, ``hybridrl/sort``).

The model is asked for the bare answer, so ``strict`` scoring is exact equality of the whitespace-
stripped response with the ground truth (1.0 / 0.0). ``flexible`` (for reporting) looks only at the
tail: the last integer (addition), the last alphanumeric word (reverse), the last ``k`` integers
where ``k`` is the length of the answer (sort).
"""

from __future__ import annotations

import re

_METHODS = ("strict", "flexible")


def _check_method(method: str) -> None:
    if method not in _METHODS:
        raise ValueError(f"synthetic-task method must be one of {_METHODS}, got {method!r}")


def addition_score(solution_str: str, ground_truth: str, method: str = "strict") -> float:
    """``ground_truth`` is the decimal sum, e.g. ``"357"``."""
    _check_method(method)
    if method == "strict":
        return float(solution_str.strip() == str(ground_truth))
    found = re.findall(r"-?\d+", solution_str)
    return float(bool(found) and found[-1] == str(ground_truth))


def reverse_score(solution_str: str, ground_truth: str, method: str = "strict") -> float:
    """``ground_truth`` is the reversed string, e.g. ``"4321"``."""
    _check_method(method)
    if method == "strict":
        return float(solution_str.strip() == str(ground_truth))
    found = re.findall(r"[A-Za-z0-9]+", solution_str)
    return float(bool(found) and found[-1] == str(ground_truth))


def sort_score(solution_str: str, ground_truth: str, method: str = "strict") -> float:
    """``ground_truth`` is the sorted numbers separated by single spaces, e.g. ``"1 2 9"``."""
    _check_method(method)
    if method == "strict":
        return float(solution_str.strip() == str(ground_truth))
    want = str(ground_truth).split()
    found = re.findall(r"-?\d+", solution_str)
    return float(len(found) >= len(want) and found[len(found) - len(want) :] == want)

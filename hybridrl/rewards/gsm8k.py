"""GSM8K scoring with verl's conventions (``verl/utils/reward_score/gsm8k.py``).

``strict``: the answer is the LAST ``#### <number>`` (exactly one space after ``####``) inside the
final 300 characters of the response; ``,`` and ``$`` are stripped and the string is compared
exactly with the ground truth. Only the tail is searched because verl does so (regex cost on long
responses, and the final answer sits at the end); a ``####`` answer earlier than that is not seen.

``flexible``: the last number-like token anywhere in the final 300 characters (``-?[0-9.,]+``), with
``,`` and ``$`` stripped and, unlike verl, a trailing ``.`` dropped. Lenient; meant for reporting the
accuracy of models that ignore the ``####`` format, not for training.
"""

from __future__ import annotations

import re

SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_METHODS = ("strict", "flexible")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string of ``solution_str`` by ``method`` (see module docstring), or None."""
    if method not in _METHODS:
        raise ValueError(f"gsm8k method must be one of {_METHODS}, got {method!r}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return _clean(found[-1]) if found else None
    for token in reversed(_NUMBER.findall(tail)):
        # Unlike verl's flexible mode, a sentence-ending "." is dropped ("is 72." -> "72"): verl would
        # compare "72." and score it wrong, which makes the lenient number less useful for reporting.
        token = _clean(token).rstrip(".")
        if token not in ("", "-"):
            return token
    return None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth``; ``format_score`` if an answer was
    extracted but differs; 0.0 if none was found (verl's rule)."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)

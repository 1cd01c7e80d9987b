"""MATH-style ``\\boxed{}`` scoring (Hendrycks et al. 2021; the lighteval / lm-eval normalisation
that verl's ``verl/utils/reward_score/math.py`` uses), plus a numeric fallback.

Pipeline: take the LAST ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``) of the response with
balanced braces, normalise it and the ground truth with :func:`normalize_answer`, compare strings.
If the strings differ but both parse as plain numbers (``0.5``, ``1/2``, ``\\frac{1}{2}``, ``-3``),
they are compared numerically (relative tolerance 1e-6), in the spirit of ``math_verify``, so that
``0.5`` and ``\\frac12`` agree. No sympy: symbolic equivalence (``2\\sqrt2`` vs ``\\sqrt8``) is not tried.
"""

from __future__ import annotations

import math
import re

_BOX_PREFIXES = ("\\boxed", "\\fbox")


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed x`` of ``text`` with its braces, or None
    (also None when the braces never close: a truncated answer does not count)."""
    start = max(text.rfind(p) for p in _BOX_PREFIXES)
    if start < 0:
        return None
    if text.startswith("\\boxed ", start):
        words = text[start + len("\\boxed ") :].split("$")[0].split()
        return "\\boxed " + words[0] if words else None
    prefix = next(p for p in _BOX_PREFIXES if text.startswith(p, start))
    if not text.startswith("{", start + len(prefix)):
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """``\\boxed{x}`` -> ``x``; ``\\boxed x`` -> ``x``; raises ValueError on anything else."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    for prefix in _BOX_PREFIXES:
        if boxed.startswith(prefix + "{") and boxed.endswith("}"):
            return boxed[len(prefix) + 1 : -1]
    raise ValueError(f"not a boxed expression: {boxed[:80]!r}")


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, tail = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + tail if b == "{" else "{" + b + "}" + tail)
    return out


def _fix_a_slash_b(s: str) -> str:
    """``3/4`` (two integers) -> ``\\frac{3}{4}``."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _remove_right_units(s: str) -> str:
    """``5 \\text{ cm}`` -> ``5`` (units written as a trailing ``\\text{ ...}`` / ``\\mbox{ ...}``)."""
    for marker in ("\\text{ ", "\\mbox{ "):
        if marker in s:
            return s.split(marker)[0]
    return s


def normalize_answer(answer: str) -> str:
    """Hendrycks-style string normalisation of a final answer (see module docstring)."""
    s = str(answer).strip().replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = _remove_right_units(s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    # "k = 3" / "x=3" -> "3": a short left-hand side is a variable name, not part of the answer.
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:
        s = rhs
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    s = _fix_a_slash_b(s)
    return s.rstrip(".")


def _as_number(s: str) -> float | None:
    """Plain numbers only: ``-3``, ``2.50``, ``1,000``, ``\\frac{a}{b}``, ``-\\frac{a}{b}``, ``a/b``."""
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s) or re.fullmatch(
        r"(-?)(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)", s
    )
    if m:
        den = float(m.group(3))
        return None if den == 0 else (-1 if m.group(1) else 1) * float(m.group(2)) / den
    try:
        return float(s) if re.fullmatch(r"-?\d+(\.\d*)?|-?\.\d+", s) else None
    except ValueError:
        return None


def is_equiv(prediction: str, ground_truth: str) -> bool:
    """Normalised string equality, else numeric equality when both are plain numbers."""
    a, b = normalize_answer(prediction), normalize_answer(ground_truth)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer of ``solution_str`` is equivalent to ``ground_truth``, else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    return 1.0 if is_equiv(remove_boxed(boxed), str(ground_truth)) else 0.0

"""Countdown scoring (TinyZero's task): reach ``target`` with each given number used exactly once.

The answer is the LAST ``<answer>...</answer>`` of the response. Scores follow TinyZero: ``score``
(1.0) for a valid equation equal to the target (within 1e-5), ``format_score`` (0.1) for an answer
that is present but uses the wrong numbers, does not parse or evaluates to something else, 0.0 when
there is no answer. The expression is evaluated by walking its AST (numbers, ``+ - * /``, unary
minus, parentheses); ``eval`` is never called, so nothing in a response can run code.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Mapping

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_EXPRESSION_CHARS = 200


def extract_equation(solution_str: str) -> str | None:
    """The content of the last ``<answer>...</answer>``, stripped, or None."""
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not allowed in a countdown equation: {ast.dump(node)[:60]}")


def evaluate_equation(equation: str) -> float | None:
    """The value of an arithmetic expression, or None if it is not one (or divides by zero)."""
    if len(equation) > _MAX_EXPRESSION_CHARS or not re.fullmatch(r"[\d+\-*/().\s]+", equation):
        return None
    try:
        return float(_eval_node(ast.parse(equation, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError):
        return None


def uses_numbers_exactly(equation: str, numbers: list[int]) -> bool:
    """True if the integers written in ``equation`` are exactly ``numbers`` (as a multiset)."""
    return sorted(int(n) for n in re.findall(r"\d+", equation)) == sorted(int(n) for n in numbers)


def compute_score(
    solution_str: str, ground_truth: Mapping, format_score: float = 0.1, score: float = 1.0
) -> float:
    """``ground_truth`` = ``{"target": int, "numbers": list[int]}`` (see module docstring)."""
    if not isinstance(ground_truth, Mapping) or not {"target", "numbers"} <= set(ground_truth):
        raise ValueError(f"countdown ground_truth must be a dict with 'target' and 'numbers', got {ground_truth!r}")
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    if not uses_numbers_exactly(equation, list(ground_truth["numbers"])):
        return float(format_score)
    value = evaluate_equation(equation)
    if value is None or abs(value - float(ground_truth["target"])) >= 1e-5:
        return float(format_score)
    return float(score)

"""Reward of the calculator task (verl's signature), plus how the answer was reached.

``solution_str`` is the whole multi-turn response as text (tool calls, tool results, answer).
score / acc: 1 when the last ``<answer>...</answer>`` equals the product; ``tool_call``: the model
called a tool; ``correct_tool_use``: one of its calls was the calculator on an expression whose
value is the product.
"""

from __future__ import annotations

import re

from hybridrl.tools.calculator import CalculatorError, evaluate
from hybridrl.tools.parser import parse_tool_calls

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def correct_call(solution_str: str, truth: int) -> bool:
    for call in parse_tool_calls(solution_str, "hermes").calls:
        expression = call.arguments.get("expression")
        if call.name == "calculator" and isinstance(expression, str):
            try:
                if evaluate(expression) == truth:
                    return True
            except CalculatorError:
                continue
    return False


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    truth = int(ground_truth)
    answers = ANSWER.findall(solution_str)
    acc = float(bool(answers) and int(answers[-1]) == truth)
    return {"score": acc, "acc": acc, "tool_call": float("<tool_call>" in solution_str),
            "correct_tool_use": float(correct_call(solution_str, truth))}

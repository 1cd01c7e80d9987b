"""The built-in calculator tool: exact integer / rational arithmetic on an expression string.

The expression is parsed with ``ast`` and only numbers, parentheses and ``+ - * / // % **`` are
evaluated (no names, calls or attributes), so model-written input can never run code. ``/`` is
exact: integer results print as integers (``84 / 4 -> 21``), others as a decimal.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from hybridrl.tools.base import BaseTool, ToolResult

MAX_EXPONENT = 1000  # 2 ** 10**9 would take the tool thread hostage for minutes
MAX_DIGITS = 4000

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic or cannot be evaluated; the message says why."""


def evaluate(expression: str) -> Fraction:
    """Exact value of an arithmetic expression; raises CalculatorError naming the problem."""
    if len(expression) > 1000:
        raise CalculatorError(f"expression too long ({len(expression)} characters, at most 1000)")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {expression!r} ({exc.msg})") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponents must be integers with |e| <= {MAX_EXPONENT}, got {right}")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        value = Fraction(value)
        if len(str(value.numerator)) > MAX_DIGITS:
            raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
        return value
    raise CalculatorError(f"only numbers and + - * / // % ** are allowed, found {type(node).__name__}")


def format_number(value: Fraction) -> str:
    """``21`` for integers, else a decimal with up to 10 significant decimals (``0.3333333333``)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


class CalculatorTool(BaseTool):
    """``calculator(expression: str)``: the exact value of an arithmetic expression."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 347 * 29"}},
                "required": ["expression"],
            },
        },
    }

    def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        expression = parameters.get("expression")
        if isinstance(expression, int | float) and not isinstance(expression, bool):
            expression = str(expression)
        if not isinstance(expression, str):
            return ToolResult(f"Error: 'expression' must be a string, got {expression!r:.80}", error=True)
        try:
            return ToolResult(format_number(evaluate(expression)))
        except CalculatorError as exc:
            return ToolResult(f"Error: {exc}", error=True)

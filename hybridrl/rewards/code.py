"""Reward for code tasks (``data_source="hybridrl/code"``): run the model's program against unit
tests in the sandbox (:mod:`hybridrl.rewards.sandbox`); 1.0 when every test passes, else 0.0.

``ground_truth`` is one of

- a string of Python test code (e.g. ``assert add(1, 2) == 3``), run after the solution in the same
  program; an exception, a limit, or an exit before the tests finish scores 0;
- a dict, or its JSON text, ``{"inputs": [stdin, ...], "outputs": [stdout, ...]}`` (verl's
  prime/codecontests layout): the program runs once per case and its stdout must equal the
  expected one up to trailing whitespace on each line.

The program is the last fenced code block of the response (```` ```python ... ``` ````), or the whole
response when it has none.
"""

from __future__ import annotations

import json
import re
from typing import Any

from hybridrl.rewards.sandbox import SandboxLimits, run_sandboxed

DATA_SOURCE = "hybridrl/code"
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(solution_str: str) -> str:
    """The last fenced code block of ``solution_str``, or all of it."""
    blocks = _FENCE.findall(solution_str)
    return blocks[-1] if blocks else solution_str


def _parse_cases(ground_truth: Any) -> tuple[list[str], list[str]] | None:
    """(inputs, outputs) for stdin/stdout tests, or None when ``ground_truth`` is test code."""
    if isinstance(ground_truth, str):
        if not ground_truth.lstrip().startswith("{"):
            return None
        ground_truth = json.loads(ground_truth)
    if not isinstance(ground_truth, dict) or not {"inputs", "outputs"} <= set(ground_truth):
        raise ValueError(f"code ground_truth must be test code or {{'inputs': [...], 'outputs': [...]}}, "
                         f"got {type(ground_truth).__name__} {str(ground_truth)[:80]!r}")
    inputs, outputs = list(ground_truth["inputs"]), list(ground_truth["outputs"])
    if len(inputs) != len(outputs):
        raise ValueError(f"code ground_truth has {len(inputs)} inputs but {len(outputs)} outputs")
    return [str(i) for i in inputs], [str(o) for o in outputs]


def _same_output(actual: str, expected: str) -> bool:
    norm = lambda text: [line.rstrip() for line in text.strip().splitlines()]  # noqa: E731
    return norm(actual) == norm(expected)


def compute_score(solution_str: str, ground_truth: Any, wall_s: float = 10.0, cpu_s: int = 5,
                  memory_mb: int = 512, **_: Any) -> float:
    """1.0 when the program passes all tests in the sandbox, else 0.0 (limits per run)."""
    limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb)
    program = extract_code(solution_str)
    cases = _parse_cases(ground_truth)
    if cases is None:
        result = run_sandboxed(f"{program}\n\n{ground_truth}\n", limits, exit_counts_as_completed=False)
        return 1.0 if result.ok else 0.0
    for stdin, expected in zip(*cases):
        result = run_sandboxed(program, limits, stdin=stdin)
        if not (result.ok and _same_output(result.stdout, expected)):
            return 0.0
    return 1.0

"""Example interaction: a teacher that checks the answer and allows retries.

After each assistant turn it extracts the answer (the last ``<answer>...</answer>``, else the last
``#### x``, else the last number), compares it with ``ground_truth`` (numbers compared as numbers):
correct -> "Correct." and the episode ends with reward 1; wrong with retries left -> feedback
("... is wrong, try again.") and reward 0, the model gets another turn; wrong with no retries left
-> the episode ends with reward 0.

``interaction_kwargs``: ``{"name": ..., "ground_truth": "42"}``; config: ``max_retries`` (default 1),
``feedback`` (the text, ``{answer}`` is replaced by the extracted answer).
"""

from __future__ import annotations

import re
from typing import Any

from hybridrl.interactions.base import BaseInteraction, last_assistant

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####\s*(\S+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The model's answer in ``text``: last <answer> tag, else last ``#### x``, else last number."""
    for pattern in (_ANSWER, _HASHES, _NUMBER):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    return None


def same_answer(answer: str | None, ground_truth: str) -> bool:
    """Equal as numbers when both parse (``1,200`` == ``1200.0``), else as stripped strings."""
    if answer is None:
        return False
    try:
        return float(answer.replace(",", "")) == float(str(ground_truth).replace(",", ""))
    except ValueError:
        return answer.strip() == str(ground_truth).strip()


class RetryFeedbackInteraction(BaseInteraction):
    """See the module docstring."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.max_retries = int(self.config.get("max_retries", 1))
        self.feedback = str(self.config.get("feedback", "Your answer {answer} is wrong. Check your work and try again."))
        self._state: dict[str, dict[str, Any]] = {}

    def start_interaction(self, instance_id: str, ground_truth: Any = None, **kwargs: Any) -> None:
        if ground_truth is None:
            raise ValueError(f"interaction {self.name!r}: interaction_kwargs needs 'ground_truth'")
        self._state[instance_id] = {"ground_truth": str(ground_truth), "retries": 0}

    def generate_response(self, instance_id: str, messages: list[dict[str, str]], **kwargs: Any):
        state = self._state[instance_id]
        answer = extract_answer(last_assistant(messages))
        if same_answer(answer, state["ground_truth"]):
            return True, "Correct.", 1.0, {"retries": state["retries"]}
        if state["retries"] >= self.max_retries:
            return True, "Wrong.", 0.0, {"retries": state["retries"]}
        state["retries"] += 1
        return False, self.feedback.format(answer=answer if answer is not None else "(none)"), 0.0, {}

    def finalize_interaction(self, instance_id: str) -> None:
        self._state.pop(instance_id, None)

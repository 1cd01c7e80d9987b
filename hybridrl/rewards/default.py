"""The default reward function: routes on ``data_source`` like verl's ``default_compute_score``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridrl.rewards import code, countdown, gsm8k, math_answer, synthetic

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
)
_ROUTES: dict[str, Callable[..., float]] = {
    **dict.fromkeys(GSM8K_SOURCES, gsm8k.compute_score),
    **dict.fromkeys(MATH_SOURCES, math_answer.compute_score),
    "countdown": countdown.compute_score,
    "hybridrl/addition": synthetic.addition_score,
    "hybridrl/reverse": synthetic.reverse_score,
    "hybridrl/sort": synthetic.sort_score,
    code.DATA_SOURCE: code.compute_score,  # runs the program in hybridrl.rewards.sandbox
}


def supported_data_sources() -> list[str]:
    """The ``data_source`` values the default reward function knows."""
    return sorted(_ROUTES)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float:
    """Score ``solution_str`` against ``ground_truth`` with the scorer registered for ``data_source``.

    ``kwargs`` (``reward_kwargs``) go to that scorer, e.g. ``method="flexible"`` for gsm8k and the
    synthetic tasks, ``format_score=0.1`` for gsm8k/countdown. ``extra_info`` is accepted for
    signature compatibility and not used by the built-in scorers.
    """
    scorer = _ROUTES.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no default reward for data_source {data_source!r}; known: {supported_data_sources()}. "
            "Set custom_reward_function.path / .name to score this data."
        )
    return scorer(solution_str, ground_truth, **kwargs)

"""Scoring and aggregation for ``hybridrl eval``: strict / lenient scores per data source and
``mean@N``, ``maj@N``, ``best@N`` over the N samples of each prompt. Pure Python (no torch).

Per sample, each data source gives two scores and the answer each one read (the majority vote
key):

=====================  ==========================================  ==========================================
data source            strict                                      lenient
=====================  ==========================================  ==========================================
openai/gsm8k           last ``#### <number>`` (verl's rule)        last number in the final 300 characters
MATH sources           last ``\\boxed{}``, normalised / numeric     the boxed answer, else the last number
countdown              ``<answer>`` equation == target (1/0)       same as strict
hybridrl/* synthetic   stripped response == answer                 the task's ``flexible`` method
custom function        its score                                   same as strict
=====================  ==========================================  ==========================================

``format`` (gsm8k: a ``#### <number>`` is present; MATH: a ``\\boxed{}``; countdown: an
``<answer>`` tag) is the fraction of responses in the expected answer format.

Aggregation over the N samples of a prompt (then averaged over the prompts of a data source):
``mean@N`` the mean score; ``best@N`` the max (pass@N for 0/1 scores); ``maj@N`` the score of
the most frequent answer (ties: the answer seen first; samples without an answer do not vote;
0 if none has one). Where no answer is extracted (synthetic lenient, custom functions) the vote
is on the whitespace-normalised response.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridrl.rewards import countdown, gsm8k, math_answer, synthetic
from hybridrl.rewards.default import GSM8K_SOURCES, MATH_SOURCES

SCORE_KINDS = ("strict", "lenient")
_SYNTHETIC = {
    "hybridrl/addition": synthetic.addition_score,
    "hybridrl/reverse": synthetic.reverse_score,
    "hybridrl/sort": synthetic.sort_score,
}
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


@dataclass(frozen=True)
class SampleScore:
    """Scores of one response: ``strict``/``lenient`` floats, the answers they read (vote keys,
    None when no answer was found) and ``formatted`` (None where the source has no format)."""

    strict: float
    lenient: float
    strict_answer: str | None
    lenient_answer: str | None
    formatted: bool | None


@dataclass(frozen=True)
class SampleRecord:
    """One scored response; ``prompt_id`` groups the N samples of one prompt."""

    prompt_id: int
    data_source: str
    score: SampleScore
    length: int
    clipped: bool


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _score_gsm8k(text: str, truth: Any) -> SampleScore:
    strict = gsm8k.extract_solution(text, "strict")
    lenient = gsm8k.extract_solution(text, "flexible")
    return SampleScore(float(strict == str(truth)), float(lenient == str(truth)), strict, lenient, strict is not None)


def _score_math(text: str, truth: Any) -> SampleScore:
    boxed = math_answer.last_boxed_only_string(text)
    strict = math_answer.remove_boxed(boxed) if boxed is not None else None
    numbers = _LAST_NUMBER.findall(text)
    lenient = strict if strict is not None else (numbers[-1].replace(",", "") if numbers else None)

    def score(answer: str | None) -> float:
        return float(answer is not None and math_answer.is_equiv(answer, str(truth)))

    def key(answer: str | None) -> str | None:  # vote on normalised answers: "0.5" and "\\frac12" agree
        return None if answer is None else math_answer.normalize_answer(answer)

    return SampleScore(score(strict), score(lenient), key(strict), key(lenient), boxed is not None)


def _score_countdown(text: str, truth: Any) -> SampleScore:
    equation = countdown.extract_equation(text)
    # format_score=0: a wrong equation is wrong for accuracy, whatever training rewarded it with
    value = countdown.compute_score(text, truth, format_score=0.0)
    return SampleScore(value, value, equation, equation, equation is not None)


def _synthetic_scorer(fn: Callable[..., float]) -> Callable[[str, Any], SampleScore]:
    def score(text: str, truth: Any) -> SampleScore:
        return SampleScore(fn(text, truth, method="strict"), fn(text, truth, method="flexible"),
                           text.strip(), _normalised(text), None)

    return score


_BUILTIN: dict[str, Callable[[str, Any], SampleScore]] = {
    **dict.fromkeys(GSM8K_SOURCES, _score_gsm8k),
    **dict.fromkeys(MATH_SOURCES, _score_math),
    "countdown": _score_countdown,
    **{source: _synthetic_scorer(fn) for source, fn in _SYNTHETIC.items()},
}


def builtin_sources() -> list[str]:
    """Data sources scored without a custom reward function."""
    return sorted(_BUILTIN)


def score_response(data_source: str, text: str, ground_truth: Any, extra_info: dict | None = None,
                   custom_fn: Callable[..., Any] | None = None) -> SampleScore:
    """Score one decoded response (see the module docstring). ``custom_fn`` (verl's signature, a
    float or a dict with ``"score"``) replaces the built-in scorers for every source."""
    if custom_fn is not None:
        value = custom_fn(data_source=data_source, solution_str=text, ground_truth=ground_truth,
                          extra_info=extra_info)
        value = float(value["score"] if isinstance(value, dict) else value)
        return SampleScore(value, value, _normalised(text), _normalised(text), None)
    scorer = _BUILTIN.get(data_source)
    if scorer is None:
        raise NotImplementedError(f"hybridrl eval has no scorer for data_source {data_source!r}; built in: "
                                  f"{builtin_sources()}. Pass --reward-function FILE.py[:NAME] to score it.")
    return scorer(text, ground_truth)


# ------------------------------------------------------------------------------ aggregation
def majority_score(answers: Sequence[str | None], scores: Sequence[float]) -> float:
    """Score of the most frequent non-None answer (first seen wins ties); 0.0 if all are None."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    winner = votes.most_common(1)[0][0]
    return float(scores[list(answers).index(winner)])


def group_metrics(groups: Iterable[list[SampleRecord]], n: int) -> dict[str, float]:
    """Metrics over prompt groups (each the samples of one prompt) of one data source."""
    groups = list(groups)
    samples = [r for g in groups for r in g]
    out: dict[str, float] = {"prompts": float(len(groups)), "samples": float(len(samples))}
    for kind in SCORE_KINDS:
        per_prompt = [[getattr(r.score, kind) for r in g] for g in groups]
        answers = [[getattr(r.score, f"{kind}_answer") for r in g] for g in groups]
        out[f"{kind}/mean@{n}"] = _mean(s for scores in per_prompt for s in scores)
        out[f"{kind}/maj@{n}"] = _mean(majority_score(a, s) for a, s in zip(answers, per_prompt))
        out[f"{kind}/best@{n}"] = _mean(max(scores) for scores in per_prompt)
    formatted = [r.score.formatted for r in samples if r.score.formatted is not None]
    if formatted:
        out[f"format/mean@{n}"] = _mean(float(f) for f in formatted)
    out["response_length/mean"] = _mean(r.length for r in samples)
    out["response_length/clip_ratio"] = _mean(float(r.clipped) for r in samples)
    return out


def aggregate(records: Sequence[SampleRecord], n: int) -> dict[str, dict[str, float]]:
    """``{data_source: metrics, ..., "all": metrics over every prompt}`` (see ``group_metrics``)."""
    by_prompt: dict[int, list[SampleRecord]] = defaultdict(list)
    for record in records:
        by_prompt[record.prompt_id].append(record)
    by_source: dict[str, list[list[SampleRecord]]] = defaultdict(list)
    for group in by_prompt.values():
        by_source[group[0].data_source].append(group)
    out = {source: group_metrics(groups, n) for source, groups in sorted(by_source.items())}
    out["all"] = group_metrics(by_prompt.values(), n)
    return out


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def format_table(results: dict[str, dict[str, float]]) -> str:
    """A fixed-width text table: one row per metric, one column per data source (``all`` last)."""
    sources = list(results)
    metrics = sorted({k for m in results.values() for k in m}, key=lambda k: (k not in ("prompts", "samples"), k))
    rows = [["metric", *sources]]
    for key in metrics:
        cells = [results[s].get(key) for s in sources]
        rows.append([key, *("-" if v is None else (f"{v:.0f}" if key in ("prompts", "samples") else f"{v:.4f}")
                            for v in cells)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)

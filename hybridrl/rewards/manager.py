"""The reward manager: responses in a DataProto -> ``token_level_scores`` (B, R).

For each row: decode the valid response tokens (``skip_special_tokens=True``), call the reward
function ``fn(data_source=, solution_str=, ground_truth=reward_model["ground_truth"], extra_info=)``
(in worker processes when ``num_workers > 0``), optionally add DAPO's overlong penalty, and put
the sequence score on the LAST VALID response token (index ``L - 1``; index 0 for an empty
response, so the score still counts when rewards are summed over tokens).

Failures (an exception, a timeout, a dead worker, NaN/inf, a value that is neither a number nor a
dict with ``"score"``) are reported with the sample index and data_source, then handled by
``on_error``: ``"fail"`` raises :class:`RewardFunctionError` (with the worker's traceback), ``"zero"``
scores 0 and counts it in ``reward/errors`` or ``reward/timeouts``.

``num_workers=0`` scores in this process: cheapest, but ``timeout_s`` cannot be enforced there (a
hung function hangs the caller); use ``num_workers >= 1`` for untrusted or slow functions.

``batched=True`` is verl's ``reward_manager=batch``: the function is called once per batch with
lists, ``fn(data_sources=, solution_strs=, ground_truths=, extra_infos=)``, and returns one result
per row (a number or a dict with ``"score"``, as above), in order. A failure of that call, or a
result that is not a list of one result per row, fails every row of the batch.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.algos.reward_shaping import overlong_penalty, scores_at_last_token
from hybridrl.protocol import DataProto
from hybridrl.rewards.default import default_compute_score
from hybridrl.rewards.loader import bind_kwargs
from hybridrl.rewards.pool import ScoringPool, TaskOutcome, run_task

logger = logging.getLogger(__name__)
_ON_ERROR = ("fail", "zero")


class RewardFunctionError(RuntimeError):
    """A reward function failed on a sample; carries ``index``, ``data_source`` and ``traceback``."""

    def __init__(self, index: int, data_source: Any, error: str, traceback: str | None = None) -> None:
        self.index, self.data_source, self.error, self.traceback = index, data_source, error, traceback
        tail = f"\n--- traceback from the reward function ---\n{traceback}" if traceback else ""
        super().__init__(f"reward function failed on sample {index} (data_source={data_source!r}): {error}{tail}")


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's soft overlong punishment (arXiv 2503.14476), verl's ``overlong_buffer``; the formula is
    :func:`hybridrl.algos.reward_shaping.overlong_penalty`: with ``expected = max_response_length -
    length``, a response of ``L`` tokens gets ``min(0, -(L - expected) / length * penalty_factor)``."""

    length: int
    penalty_factor: float
    max_response_length: int

    def __post_init__(self) -> None:
        if not 0 < self.length <= self.max_response_length:
            raise ValueError(
                f"overlong_buffer.len must be in (0, max_response_length={self.max_response_length}], got {self.length}"
            )
        if self.penalty_factor < 0:
            raise ValueError(f"overlong_buffer.penalty_factor must be >= 0, got {self.penalty_factor}")


def response_lengths(data: DataProto) -> torch.Tensor:
    """(B,) number of tokens up to and including the last valid one of each response.

    Uses the response part of ``attention_mask`` (B, T) when present, else ``response_mask`` (B, R);
    "last nonzero + 1" rather than a sum, so interior zeros (multi-turn tool tokens) do not shorten it.
    """
    resp_len = data.batch["responses"].shape[1]
    if "attention_mask" in data.batch:
        mask = data.batch["attention_mask"][:, -resp_len:]
    elif "response_mask" in data.batch:
        mask = data.batch["response_mask"]
    else:
        raise KeyError("RewardManager needs 'attention_mask' (B,T) or 'response_mask' (B,R) besides 'responses'")
    positions = torch.arange(1, resp_len + 1, device=mask.device).expand_as(mask)
    return (positions * (mask != 0)).amax(dim=1) if resp_len else torch.zeros(len(data), dtype=torch.long)


def normalize_result(value: Any) -> tuple[float, dict[str, Any]]:
    """A reward function's return -> (score, extra fields); TypeError/ValueError if unusable."""
    extras: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"returned a dict without a 'score' key (keys: {sorted(value)})")
        extras = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}; expected a float or a dict with 'score'")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    return score, extras


@dataclass
class _Failure:
    index: int
    data_source: Any
    error: str
    traceback: str | None
    timed_out: bool


class RewardManager:
    """Scores a batch of responses; see the module docstring.

    Args:
        tokenizer: decodes ``responses``.
        compute_score: a function with verl's signature; None -> ``default_compute_score``. To load
            one from a file use :func:`hybridrl.rewards.load_reward_function` (it pickles by path).
        reward_kwargs: extra keyword arguments for every call.
        num_workers: scoring processes (0: in this process, no timeout).
        timeout_s: per-sample limit when ``num_workers > 0``; a hung worker is killed and replaced.
        on_error: ``"fail"`` or ``"zero"``.
        overlong_buffer: DAPO overlong penalty, or None.
        mp_context: ``"spawn"`` or ``"forkserver"`` for the worker processes.
        reward_fn_key: the non-tensor column passed as ``data_source`` (``data.reward_fn_key``).
        batched: call the function once per batch with lists (module docstring); ``timeout_s`` then
            limits that one call.
    """

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        reward_kwargs: dict[str, Any] | None = None,
        num_workers: int = 0,
        timeout_s: float = 30.0,
        on_error: str = "fail",
        overlong_buffer: OverlongBuffer | None = None,
        mp_context: str = "spawn",
        reward_fn_key: str = "data_source",
        batched: bool = False,
    ) -> None:
        if on_error not in _ON_ERROR:
            raise ValueError(f"reward on_error must be one of {_ON_ERROR}, got {on_error!r}")
        if num_workers < 0 or timeout_s <= 0:
            raise ValueError(f"reward num_workers must be >= 0 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self.tokenizer = tokenizer
        self.score_fn = bind_kwargs(compute_score or default_compute_score, reward_kwargs)
        self.num_workers, self.timeout_s, self.on_error = num_workers, timeout_s, on_error
        self.overlong_buffer, self.reward_fn_key, self.batched = overlong_buffer, reward_fn_key, batched
        self._pool = ScoringPool(num_workers, timeout_s, mp_context) if num_workers > 0 else None

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, Any]]:
        """DataProto with ``responses`` (B, R) + masks and non-tensor ``data_source``, ``reward_model``
        (``extra_info`` optional) -> (``token_level_scores`` (B, R) float32, extra), where extra is
        ``{"reward_extra_info": {key: list of B}, "metrics": {name: float}, "errors": [...]}``.
        A batch a reward model scored (``rm_scores``) gets those scores instead, as in verl."""
        if "rm_scores" in data.batch:
            return data.batch["rm_scores"].float(), {"reward_extra_info": {}, "metrics": {}, "errors": []}
        lengths = response_lengths(data)
        tasks = self._build_tasks(data, lengths)
        outcomes = self._score_batch(tasks) if self.batched else self._score(tasks)
        scores, per_sample, failures = self._collect(outcomes, tasks)
        metrics = {
            "reward/errors": float(sum(not f.timed_out for f in failures)),
            "reward/timeouts": float(sum(f.timed_out for f in failures)),
        }
        if self.overlong_buffer is not None:
            buf = self.overlong_buffer
            penalty = overlong_penalty(lengths, buf.max_response_length, buf.length, buf.penalty_factor)
            scores = scores + penalty
            per_sample["overlong_reward"] = penalty.tolist()
            per_sample["overlong"] = (penalty < 0).tolist()
            metrics["reward/overlong_ratio"] = float((penalty < 0).float().mean()) if len(penalty) else 0.0
        metrics.update(_extra_means(per_sample))
        token_level_scores = scores_at_last_token(scores, lengths, data.batch["responses"].shape[1])
        errors = [vars(f) for f in failures]
        return token_level_scores, {"reward_extra_info": per_sample, "metrics": metrics, "errors": errors}

    def _build_tasks(self, data: DataProto, lengths: torch.Tensor) -> list[dict[str, Any]]:
        """One keyword-argument dict per row, in verl's reward-function signature."""
        nt = data.non_tensor_batch
        for key in (self.reward_fn_key, "reward_model"):
            if key not in nt:
                raise KeyError(f"RewardManager needs the non-tensor column {key!r}; the batch has {sorted(nt)}")
        responses = data.batch["responses"]
        token_lists = [responses[i, : int(n)].tolist() for i, n in enumerate(lengths)]
        texts = self.tokenizer.batch_decode(token_lists, skip_special_tokens=True)
        extra_info = nt.get("extra_info")
        tasks = []
        for i, text in enumerate(texts):
            reward_model = nt["reward_model"][i]
            if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
                raise ValueError(
                    f"sample {i}: reward_model must be a dict with 'ground_truth', got {reward_model!r:.120}"
                )
            tasks.append(
                {
                    "data_source": nt[self.reward_fn_key][i],
                    "solution_str": text,
                    "ground_truth": reward_model["ground_truth"],
                    "extra_info": None if extra_info is None else extra_info[i],
                }
            )
        return tasks

    def _score(self, tasks: list[dict[str, Any]]) -> list[TaskOutcome]:
        return self._pool.map(self.score_fn, tasks) if self._pool else [run_task(self.score_fn, t) for t in tasks]

    def _score_batch(self, tasks: list[dict[str, Any]]) -> list[TaskOutcome]:
        """One call with the rows' lists (verl's batch signature) -> one outcome per row."""
        if not tasks:
            return []
        lists = {plural: [t[key] for t in tasks] for key, plural in
                 (("data_source", "data_sources"), ("solution_str", "solution_strs"),
                  ("ground_truth", "ground_truths"), ("extra_info", "extra_infos"))}
        (outcome,) = self._score([lists])
        if outcome.ok and not (isinstance(outcome.value, list | tuple) and len(outcome.value) == len(tasks)):
            got = f"{type(outcome.value).__name__} of {len(outcome.value)}" if isinstance(
                outcome.value, list | tuple) else repr(outcome.value)[:80]
            outcome = TaskOutcome(error=f"a batched reward function must return a list of {len(tasks)} results "
                                        f"(one per row, in order), got {got}")
        if not outcome.ok:
            return [outcome] * len(tasks)
        return [TaskOutcome(value=value) for value in outcome.value]

    def _collect(
        self, outcomes: list[TaskOutcome], tasks: list[dict[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, list], list[_Failure]]:
        """Outcomes -> (scores (B,), per-sample extra lists incl. "score", failures); applies on_error."""
        scores, extras, failures = [], [], []
        for i, outcome in enumerate(outcomes):
            error, tb = outcome.error, outcome.traceback
            if outcome.ok:
                try:
                    score, fields = normalize_result(outcome.value)
                except (TypeError, ValueError) as exc:
                    error, tb = f"{type(exc).__name__}: {exc}", None
            if error is not None:
                failure = _Failure(i, tasks[i]["data_source"], error, tb, outcome.timed_out)
                if self.on_error == "fail":
                    raise RewardFunctionError(failure.index, failure.data_source, failure.error, failure.traceback)
                if len(failures) < 5:  # the metric counts them all; the log shows the first few per batch
                    logger.warning("reward scored 0 for sample %d (data_source=%r): %s", i, failure.data_source, error)
                failures.append(failure)
                score, fields = 0.0, {}
            scores.append(score)
            extras.append(fields)
        keys = sorted({k for fields in extras for k in fields})
        per_sample = {"score": list(scores), **{k: [fields.get(k) for fields in extras] for k in keys}}
        return torch.tensor(scores, dtype=torch.float32), per_sample, failures

    def close(self) -> None:
        """Stop the scoring processes (also done at interpreter exit: they are daemons)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _extra_means(per_sample: dict[str, list]) -> dict[str, float]:
    """``reward/<key>/mean`` for every extra key whose values are all numbers (None skipped)."""
    out = {}
    for key, values in per_sample.items():
        present = [v for v in values if v is not None]
        if key != "score" and present and all(isinstance(v, numbers.Real) for v in present):
            out[f"reward/{key}/mean"] = float(sum(float(v) for v in present) / len(present))
    return out

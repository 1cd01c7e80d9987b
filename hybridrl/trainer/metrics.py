"""Step metrics under verl's names, so hybridrl curves line up with verl runs.

Shapes: ``B`` sequences, ``P`` prompt length, ``R`` response length (see hybridrl.protocol).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from hybridrl.protocol import DataProto


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def compute_data_metrics(batch: DataProto, use_critic: bool) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one training batch.

    ``critic/score`` is the sequence sum of ``token_level_scores`` (B,R); ``critic/rewards`` the
    same for ``token_level_rewards``; advantages / returns / values are taken over valid response
    tokens; ``response_length/clip_ratio`` is the fraction of responses that hit the length limit;
    ``num_turns/*`` and ``tool_call_counts/*`` (mean/max/min per sequence) when the rollout was multi-turn.
    """
    b = batch.batch
    response_mask = b["response_mask"].bool()
    max_response_len = b["responses"].shape[-1]
    prompt_len = b["attention_mask"][:, :-max_response_len].sum(-1).float()
    max_prompt_len = b["attention_mask"].shape[-1] - max_response_len
    response_len = b["attention_mask"][:, -max_response_len:].sum(-1).float()
    metrics = {
        **_stats("critic/score", b["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", b["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", b["advantages"][response_mask]),
        **_stats("critic/returns", b["returns"][response_mask]),
        **_stats("response_length", response_len),
        "response_length/clip_ratio": (response_len == max_response_len).float().mean().item(),
        **_stats("prompt_length", prompt_len),
        "prompt_length/clip_ratio": (prompt_len == max_prompt_len).float().mean().item(),
    }
    for key in ("num_turns", "tool_call_counts"):  # multi-turn rollouts (hybridrl.rollout.agent_loop)
        if key in batch.non_tensor_batch:
            metrics.update(_stats(key, torch.as_tensor(batch.non_tensor_batch[key].astype(np.float64))))
    if use_critic and "values" in b:
        values = b["values"][response_mask]
        returns = b["returns"][response_mask]
        metrics.update(_stats("critic/values", values))
        var_returns = torch.var(returns)
        metrics["critic/vf_explained_var"] = (1.0 - torch.var(returns - values) / (var_returns + 1e-5)).item()
    return metrics


def compute_throughput_metrics(batch: DataProto, step_time_s: float, n_devices: int) -> dict[str, float]:
    """``perf/throughput`` = real tokens (prompt + response) per second per device, as verl reports."""
    total_tokens = int(batch.batch["attention_mask"].sum().item())
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_time_s,
        "perf/throughput": total_tokens / max(step_time_s, 1e-9) / max(n_devices, 1),
    }


def compute_timing_metrics(batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
    """``timing_s/<phase>`` and ``timing_per_token_ms/<phase>`` (ms per real token handled)."""
    response_tokens = float(batch.batch["response_mask"].sum().item()) if "response_mask" in batch else 0.0
    all_tokens = float(batch.batch["attention_mask"].sum().item()) if "attention_mask" in batch else 0.0
    per_phase_tokens = {"gen": response_tokens}
    out = {f"timing_s/{k}": v for k, v in timing.items()}
    for phase, seconds in timing.items():
        if phase in ("step", "testing", "save_checkpoint"):
            continue
        tokens = per_phase_tokens.get(phase, all_tokens)
        if tokens > 0:
            out[f"timing_per_token_ms/{phase}"] = seconds * 1000.0 / tokens
    return out


def reduce_metrics(metrics: dict[str, list[float]]) -> dict[str, float]:
    """Mean of each list of per-micro-batch (or per-rank) values."""
    return {k: float(np.mean(v)) for k, v in metrics.items() if len(v)}


class Timer:
    """Collects ``timing_s`` per phase: ``with timer("gen"): ...``."""

    def __init__(self) -> None:
        self.timing: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timing[name] += time.perf_counter() - start

"""Metric trackers for ``trainer.logger``: console, file (JSONL), tensorboard, wandb, mlflow.

A backend whose package is missing fails when the run starts, with the command that installs it,
never at the first log call hours later.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

BACKENDS = ("console", "file", "tensorboard", "wandb", "mlflow")
_PACKAGES = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow")}


class Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


def _require(name: str):
    module, extra = _PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise RuntimeError(
            f"trainer.logger includes {name!r} but its package is not installed ({err.name}); "
            f"install it with: pip install 'hybridrl[{extra}]'"
        ) from err


class ConsoleBackend:
    """One line per step, metrics sorted by name, floats short."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = [f"{k}:{_fmt(v)}" for k, v in sorted(metrics.items())]
        print(f"step:{step} - " + " - ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        pass


class FileBackend:
    """Appends one JSON object per step to ``<dir>/metrics.jsonl`` (flushed every line, so a
    killed run keeps everything it logged)."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.path = Path(log_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class TensorboardBackend:
    def __init__(self, log_dir: str | os.PathLike) -> None:
        tb = _require("tensorboard")
        self.writer = tb.SummaryWriter(str(Path(log_dir) / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(self, project: str, experiment: str, config: dict[str, Any]) -> None:
        self.wandb = _require("wandb")
        self.run = self.wandb.init(project=project, name=experiment, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowBackend:
    def __init__(self, experiment: str, config: dict[str, Any]) -> None:
        self.mlflow = _require("mlflow")
        self.mlflow.set_experiment(experiment)
        self.mlflow.start_run()
        self.mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        # mlflow metric names allow only [A-Za-z0-9_-. /]; verl's '@' in val-core names is mapped.
        self.mlflow.log_metrics({k.replace("@", "_at_"): float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class Tracking:
    """Fan-out to every backend named in ``trainer.logger``."""

    def __init__(self, backends: Sequence[str], log_dir: str | os.PathLike, project: str = "hybridrl",
                 experiment: str = "run", config: dict[str, Any] | None = None) -> None:
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown backend(s) {unknown}; valid: {list(BACKENDS)}")
        config = config or {}
        makers = {
            "console": lambda: ConsoleBackend(),
            "file": lambda: FileBackend(log_dir),
            "tensorboard": lambda: TensorboardBackend(log_dir),
            "wandb": lambda: WandbBackend(project, experiment, config),
            "mlflow": lambda: MlflowBackend(experiment, config),
        }
        self.backends: dict[str, Backend] = {b: makers[b]() for b in dict.fromkeys(backends)}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        for backend in self.backends.values():
            backend.log(clean, step)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()


def _fmt(v: float) -> str:
    if isinstance(v, float) and math.isfinite(v) and v != int(v):
        return f"{v:.4g}"
    return str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep the fact visible instead of dropping it
    return v


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out

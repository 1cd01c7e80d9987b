"""Loading reward functions with verl's signature from a Python file.

``compute_score(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs)`` returning
a float or a dict with a ``"score"`` key. A function loaded from a file cannot be pickled by
reference (its module is not importable by name), so :class:`FileRewardFunction` pickles as
``(path, name)`` and re-loads the file in whichever process calls it: that is how custom functions
reach the scoring worker processes (spawned, so nothing is inherited).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Per-process cache: one module object per file, so a file is executed once per process.
_LOADED: dict[str, Any] = {}


def _load_module(path: Path) -> Any:
    key = str(path)
    if key not in _LOADED:
        module_name = "hybridrl_reward_" + hashlib.sha1(key.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load reward function file {path}: not a Python source file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses / pickling inside the file need this
        spec.loader.exec_module(module)
        _LOADED[key] = module
    return _LOADED[key]


class FileRewardFunction:
    """A reward function ``name`` defined in the Python file ``path``; picklable, loads lazily."""

    def __init__(self, path: str | Path, name: str = "compute_score") -> None:
        self.path = Path(path).expanduser().resolve()
        self.name = name
        if not self.path.is_file():
            raise FileNotFoundError(f"custom_reward_function.path: reward function file not found: {self.path}")
        self.load()  # fail early, in the driver, on a missing name or a syntax error

    def load(self) -> Callable[..., Any]:
        module = _load_module(self.path)
        fn = getattr(module, self.name, None)
        if fn is None or not callable(fn):
            defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise AttributeError(
                f"custom_reward_function.name: {self.name!r} is not a function in {self.path}; "
                f"callables defined there: {defined}"
            )
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.name = Path(state["path"]), state["name"]

    def __repr__(self) -> str:
        return f"FileRewardFunction({str(self.path)!r}, {self.name!r})"


def load_reward_function(
    path: str | Path | None = None, name: str = "compute_score", reward_kwargs: dict | None = None
) -> Callable[..., Any]:
    """The reward function to use: the one in ``path`` (attribute ``name``) or, without a path,
    :func:`hybridrl.rewards.default.default_compute_score`; ``reward_kwargs`` are bound as keyword
    arguments. The result pickles (for worker processes)."""
    from hybridrl.rewards.default import default_compute_score

    fn: Callable[..., Any] = FileRewardFunction(path, name) if path else default_compute_score
    return bind_kwargs(fn, reward_kwargs)


def bind_kwargs(fn: Callable[..., Any], reward_kwargs: dict | None) -> Callable[..., Any]:
    """``fn`` with ``reward_kwargs`` bound as keyword arguments (a picklable ``functools.partial``)."""
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn

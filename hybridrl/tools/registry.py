"""The tool registry: tools by name, built from verl's tool-config YAML, and run with time limits.

YAML format (verl's ``tool_config_path`` file)::

    tools:
      - class_name: calculator            # a built-in name, or a dotted path to a class
        config: {timeout_s: 5}            # passed to the class as ``config``
        tool_schema:                      # optional for built-ins (they carry a default schema)
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, ...}}

A class is called as ``cls(config=..., tool_schema=...)`` (verl's constructor) and must satisfy
:class:`hybridrl.tools.base.Tool`.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridrl.tools.base import Tool, ToolResult, check_arguments, to_result
from hybridrl.tools.parser import ToolCall

BUILTIN_TOOLS = {
    "calculator": "hybridrl.tools.calculator.CalculatorTool",
    "python": "hybridrl.tools.python_tool.PythonTool",
}
_ENTRY_KEYS = ("class_name", "config", "tool_schema")
TOOLS_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


class ToolConfigError(ValueError):
    """A tool-config file is malformed; the message names the file, the entry and the key."""


@dataclass
class CallJob:
    """One tool call of one sample: what to run, with that sample's ``execute_kwargs``."""

    call: ToolCall
    instance_id: str
    execute_kwargs: dict[str, Any] = field(default_factory=dict)


class ToolRegistry:
    """Tools by name. ``max_concurrency``: calls running at once in ``execute`` (threads)."""

    def __init__(self, tools: Iterable[Tool], max_concurrency: int = 32) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                raise TypeError(f"{type(tool).__name__} is not a Tool (needs name, schema, timeout_s, create, "
                                "execute, calc_reward, release)")
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}; tool names must be unique")
            self.tools[tool.name] = tool
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency

    def __len__(self) -> int:
        return len(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas (for ``apply_chat_template(tools=...)``)."""
        return [tool.schema for tool in self.tools.values()]

    # ------------------------------------------------------------------------ per-sample lifecycle
    def create(self, instance_id: str, tools_kwargs: dict[str, Any] | None) -> None:
        """Create this sample's instance of every tool with its ``create_kwargs``."""
        kwargs = check_tools_kwargs(tools_kwargs, self.tools)
        for name, tool in self.tools.items():
            tool.create(instance_id, **kwargs.get(name, {}).get("create_kwargs", {}))

    def finish(self, instance_id: str, tools_kwargs: dict[str, Any] | None) -> dict[str, float]:
        """``calc_reward`` then ``release`` of every tool; returns the reward per tool name."""
        kwargs = check_tools_kwargs(tools_kwargs, self.tools)
        rewards = {}
        for name, tool in self.tools.items():
            rewards[name] = float(tool.calc_reward(instance_id, **kwargs.get(name, {}).get("calc_reward_kwargs", {})))
            tool.release(instance_id, **kwargs.get(name, {}).get("release_kwargs", {}))
        return rewards

    # ---------------------------------------------------------------------------------- execution
    def execute(self, jobs: Sequence[CallJob]) -> list[ToolResult]:
        """Run every call, ``max_concurrency`` at a time, each bounded by its tool's ``timeout_s``.

        Never raises for what a tool does: an unknown tool, bad arguments, an exception or a
        time-out becomes a ``ToolResult(error=True)`` whose text tells the model what happened.
        Calls run in daemon threads; one that hangs is abandoned (it cannot block shutdown).
        """
        results: list[ToolResult] = []
        for start in range(0, len(jobs), self.max_concurrency):
            results += self._execute_wave(jobs[start : start + self.max_concurrency])
        return results

    def _execute_wave(self, jobs: Sequence[CallJob]) -> list[ToolResult]:
        slots: list[ToolResult | None] = [None] * len(jobs)
        threads: list[threading.Thread | None] = []
        started = time.monotonic()
        for i, job in enumerate(jobs):
            tool = self.tools.get(job.call.name)
            problem = self._precheck(job.call, tool)
            if problem is not None:
                slots[i] = ToolResult(f"Error: {problem}", error=True)
                threads.append(None)
                continue
            thread = threading.Thread(target=_run_call, args=(tool, job, slots, i), daemon=True,
                                      name=f"hybridrl-tool-{job.call.name}")
            thread.start()
            threads.append(thread)
        for i, (job, thread) in enumerate(zip(jobs, threads)):
            if thread is None:
                continue
            timeout = self.tools[job.call.name].timeout_s
            thread.join(max(0.0, started + timeout - time.monotonic()))  # all calls of a wave started together
            if thread.is_alive():
                slots[i] = ToolResult(f"Error: tool {job.call.name!r} timed out after {timeout:g} s", error=True)
        return [s if s is not None else ToolResult("Error: the tool returned nothing", error=True) for s in slots]

    def _precheck(self, call: ToolCall, tool: Tool | None) -> str | None:
        if tool is None:
            return f"unknown tool {call.name!r}; available tools: {sorted(self.tools)}"
        return check_arguments(tool.schema, call.arguments)


def _run_call(tool: Tool, job: CallJob, slots: list[ToolResult | None], i: int) -> None:
    """Thread body: the result or the error text lands in ``slots[i]``."""
    try:
        slots[i] = to_result(tool.execute(job.instance_id, dict(job.call.arguments), **job.execute_kwargs))
    except Exception as exc:  # noqa: BLE001 - any tool failure is reported to the model, not raised
        slots[i] = ToolResult(f"Error: {type(exc).__name__}: {exc}", error=True)


def check_tools_kwargs(tools_kwargs: Any, tools: dict[str, Tool]) -> dict[str, dict[str, dict]]:
    """Validate ``extra_info["tools_kwargs"]``: ``{tool name: {create_kwargs|execute_kwargs|...: {...}}}``."""
    if tools_kwargs is None:
        return {}
    if not isinstance(tools_kwargs, dict):
        raise ValueError(f"extra_info.tools_kwargs must be a mapping of tool name -> kwargs, got {tools_kwargs!r:.120}")
    for name, kwargs in tools_kwargs.items():
        if name not in tools:
            raise ValueError(f"extra_info.tools_kwargs names tool {name!r}, which is not configured; tools: {sorted(tools)}")
        if not isinstance(kwargs, dict) or set(kwargs) - set(TOOLS_KWARGS_KEYS):
            raise ValueError(f"extra_info.tools_kwargs[{name!r}] must be a mapping with keys among "
                             f"{list(TOOLS_KWARGS_KEYS)}, got {kwargs!r:.120}")
        for key, value in kwargs.items():
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"extra_info.tools_kwargs[{name!r}][{key!r}] must be a mapping, got {value!r:.80}")
    return {name: {k: dict(v or {}) for k, v in kwargs.items()} for name, kwargs in tools_kwargs.items()}


# -------------------------------------------------------------------------------------- loading
def import_object(path: str, where: str) -> Any:
    """``package.module.Name`` -> the object; errors name ``where``."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ToolConfigError(f"{where}: {path!r} is not a dotted path (package.module.ClassName)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = " (verl's own tools are not part of hybridrl; port the class)" if path.startswith("verl.") else ""
        raise ToolConfigError(f"{where}: cannot import {module_name!r}: {exc}{hint}") from exc
    if not hasattr(module, attr):
        raise ToolConfigError(f"{where}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def load_tool_config(path: str | Path, max_concurrency: int = 32) -> ToolRegistry:
    """Build a :class:`ToolRegistry` from a verl-format tool-config YAML file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ToolConfigError(f"tool config {path} does not exist (actor_rollout_ref.rollout.multi_turn.tool_config_path)")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{path}: the file must be a mapping with a 'tools' list")
    return ToolRegistry([_build_tool(entry, f"{path} tools[{i}]") for i, entry in enumerate(data["tools"])],
                        max_concurrency=max_concurrency)


def _build_tool(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ToolConfigError(f"{where}: each tool must be a mapping with a string 'class_name'")
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        raise ToolConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(_ENTRY_KEYS)}")
    config, schema = entry.get("config") or {}, entry.get("tool_schema")
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}.config must be a mapping, got {config!r:.80}")
    cls = import_object(BUILTIN_TOOLS.get(entry["class_name"], entry["class_name"]), f"{where}.class_name")
    try:
        return cls(config=config, tool_schema=schema)
    except (TypeError, ValueError) as exc:
        raise ToolConfigError(f"{where}: building {entry['class_name']!r} failed: {exc}") from exc

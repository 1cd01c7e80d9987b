"""The tool interface of multi-turn rollouts (verl's ``BaseTool`` lifecycle, synchronous).

A tool has an OpenAI function schema (``{"type": "function", "function": {"name", "description",
"parameters"}}``) and four steps per episode (one *instance* per sample, keyed by ``instance_id``):

    create(instance_id, **create_kwargs)             once, before the first turn
    execute(instance_id, parameters, **execute_kwargs) -> ToolResult   per call the model makes
    calc_reward(instance_id) -> float                once, after the last turn
    release(instance_id)                             once, at the end

``create_kwargs`` / ``execute_kwargs`` come per sample from ``extra_info["tools_kwargs"][<tool name>]``
(verl's data format). ``execute`` may return a string, a ``ToolResult`` or verl's tuple
``(text, reward, metrics)``; anything it raises becomes an error message the model reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class ToolResult:
    """What a tool call returns to the model (``text``) and to the trainer (``reward``, ``metrics``)."""

    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: bool = False
    """True when the call failed (raised, timed out, bad arguments): the text is the error message."""


@runtime_checkable
class Tool(Protocol):
    """What the agent loop needs from a tool (see the module docstring for the lifecycle)."""

    name: str
    schema: dict[str, Any]
    timeout_s: float

    def create(self, instance_id: str, **create_kwargs: Any) -> None: ...
    def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> Any: ...
    def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float: ...
    def release(self, instance_id: str, **release_kwargs: Any) -> None: ...


class BaseTool:
    """Convenience base for tools written in Python: stores the schema and config, and makes every
    lifecycle step but ``execute`` a no-op. Subclasses implement ``execute``.

    config: the tool's ``config`` mapping from the YAML file; ``timeout_s`` (default 10) bounds one call.
    tool_schema: the OpenAI function schema; ``tool_schema["function"]["name"]`` is the tool's name.
    """

    default_schema: dict[str, Any] | None = None

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        schema = tool_schema or self.default_schema
        if schema is None:
            raise ValueError(f"{type(self).__name__} needs a tool_schema (it has no default one)")
        self.schema = check_schema(schema, type(self).__name__)
        self.name = self.schema["function"]["name"]
        self.timeout_s = float(self.config.get("timeout_s", 10.0))
        if self.timeout_s <= 0:
            raise ValueError(f"tool {self.name!r}: config.timeout_s must be > 0, got {self.timeout_s}")

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        """Per-sample setup; the default keeps nothing."""

    def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.execute")

    def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        """The episode's tool reward (reported in ``extra_info["rollout_reward_scores"]``); default 0."""
        return 0.0

    def release(self, instance_id: str, **release_kwargs: Any) -> None:
        """Per-sample teardown; the default has nothing to free."""


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """Validate an OpenAI function schema; errors name ``where`` and the missing key."""
    if not isinstance(schema, dict) or schema.get("type") != "function":
        raise ValueError(f"{where}: tool_schema must be a mapping with type: function, got {schema!r:.200}")
    function = schema.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}: tool_schema.function must be a mapping with a non-empty string 'name'")
    params = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ValueError(f"{where}: tool_schema.function.parameters must be a JSON schema of type object")
    return {"type": "function", "function": {**function, "parameters": params}}


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """A message naming what is wrong with the model's ``arguments`` (missing required or unknown
    parameters, wrong JSON types), or None when they fit the schema's top level."""
    params = schema["function"]["parameters"]
    props: dict[str, Any] = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}; the tool takes {sorted(props)}"
    unknown = [k for k in arguments if props and k not in props]
    if unknown:
        return f"unknown argument(s) {unknown}; the tool takes {sorted(props)}"
    for key, value in arguments.items():
        expected = props.get(key, {}).get("type")
        if expected and not _json_type_ok(value, expected):
            return f"argument {key!r} must be of JSON type {expected}, got {type(value).__name__}"
    return None


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def _json_type_ok(value: Any, expected: str | list[str]) -> bool:
    names = [expected] if isinstance(expected, str) else list(expected)
    for name in names:
        types = _JSON_TYPES.get(name)
        if types is None:
            return True  # a type we do not check
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, types):
            return True
    return False


def to_result(value: Any) -> ToolResult:
    """Normalize what ``execute`` returned: str, ToolResult, or verl's ``(text, reward, metrics)``."""
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, str):
        return ToolResult(value)
    if isinstance(value, tuple) and len(value) == 3:
        text, reward, metrics = value
        text = getattr(text, "text", text)  # verl's ToolResponse carries .text
        return ToolResult(str(text), float(reward or 0.0), dict(metrics or {}))
    raise TypeError(f"a tool's execute must return str, ToolResult or (text, reward, metrics); got {type(value).__name__}")

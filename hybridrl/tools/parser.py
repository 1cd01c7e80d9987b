"""Tool-call parsing: the text of one assistant turn -> the calls the model made.

Formats (``multi_turn.format``):

- ``hermes`` (Qwen2.5, Hermes, verl's default): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text
  outside the tags is the message content.
- ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole turn, optionally after
  ``<|python_tag|>``, is one JSON object ``{"name": ..., "parameters": {...}}`` (or a list of them).

A call the model got wrong (bad JSON, no name, arguments not an object) is not dropped: it is
returned in ``errors`` so the agent loop can answer with an error message and the model learns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """``content``: the turn's text without the calls; ``calls`` in order; ``errors``: one message per
    malformed call."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks; an unclosed ``<tool_call>`` is reported as an error."""
    turn = ParsedTurn(HERMES_CALL.sub("", text).strip())
    for body in HERMES_CALL.findall(text):
        _add_call(turn, body.strip(), args_key="arguments")
    if "<tool_call>" in HERMES_CALL.sub("", text):
        turn.errors.append("a <tool_call> block was not closed with </tool_call>")
    return turn


def parse_llama3_json(text: str) -> ParsedTurn:
    """A turn that is (after an optional ``<|python_tag|>``) a JSON call object or list of them;
    any other turn is plain content."""
    body = text.split(PYTHON_TAG, 1)[1] if PYTHON_TAG in text else text
    body = body.strip()
    if not body.startswith(("{", "[")) or '"name"' not in body:
        return ParsedTurn(text.strip())
    turn = ParsedTurn("")
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        turn.errors.append(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
        return turn
    for item in value if isinstance(value, list) else [value]:
        _add_call(turn, item, args_key="parameters")
    return turn


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedTurn:
    """Parse one assistant turn in format ``fmt`` (one of ``PARSERS``)."""
    if fmt not in PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r} (actor_rollout_ref.rollout.multi_turn.format); "
                         f"allowed: {sorted(PARSERS)}")
    return PARSERS[fmt](text)


def _add_call(turn: ParsedTurn, body: str | Any, args_key: str) -> None:
    """Decode one call (a JSON string or an already-decoded value) into ``turn.calls`` or ``turn.errors``."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError as exc:
            turn.errors.append(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
            return
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        turn.errors.append('a tool call must be a JSON object with a string "name"')
        return
    args = body.get(args_key, body.get("arguments", body.get("parameters", {})))
    if isinstance(args, str):  # some models emit the arguments as a JSON string (OpenAI's wire format)
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            turn.errors.append(f"the arguments of {body['name']!r} are a string that is not a JSON object")
            return
    if not isinstance(args, dict):
        turn.errors.append(f'the "{args_key}" of {body["name"]!r} must be a JSON object')
        return
    turn.calls.append(ToolCall(body["name"], args))

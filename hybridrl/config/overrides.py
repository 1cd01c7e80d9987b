"""Parse command-line overrides in Hydra's syntax, without Hydra.

    key=value      set an existing key             +key=value   add a key (dict extension points)
    ++key=value    set or add                      ~key         delete (extension) / reset (schema key)

Values follow Hydra's grammar: ``null``; ``true``/``false`` (any case); ints; floats (``1e-6``,
``.5``, ``inf``, ``nan``); quoted strings (``'a b'``, ``"x"``) stay strings; lists ``[a,'b',1]`` and
dicts ``{a: 1}`` nest; anything else is an unquoted string (``~/data/x.parquet``, ``${a.b}``).
Unlike YAML, ``yes``/``no``/``on``/``off`` stay strings, so a run named ``no`` keeps its name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hybridrl.config.errors import ConfigError

_INT = re.compile(r"^[+-]?\d+(_\d+)*$")
_FLOAT = re.compile(r"^[+-]?((\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?|inf|nan)$", re.IGNORECASE)
_KEY = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")


@dataclass(frozen=True)
class Override:
    """One parsed override. ``op`` is set | add | force | delete; ``value`` is None for a bare delete."""

    op: str
    key: str
    value: Any
    text: str
    has_value: bool = True


def parse_override(text: str) -> Override:
    """Split ``[+|++|~]key[=value]`` and parse the value; errors quote the override."""
    op, rest = "set", text
    for prefix, name in (("++", "force"), ("+", "add"), ("~", "delete")):
        if rest.startswith(prefix):
            op, rest = name, rest[len(prefix):]
            break
    key, sep, raw = rest.partition("=")
    key = key.strip()
    if not _KEY.match(key):
        raise ConfigError(f"override {text!r}: {key!r} is not a key path; expected key=value, +key=value, "
                          "++key=value or ~key (a key path is names joined by dots, e.g. trainer.total_epochs)")
    if not sep:
        if op != "delete":
            raise ConfigError(f"override {text!r}: missing '=value' (write {key}=VALUE; ~{key} deletes)")
        return Override(op, key, None, text, has_value=False)
    try:
        value = parse_value(raw)
    except ValueError as err:
        raise ConfigError(f"override {text!r}: cannot parse the value {raw!r}: {err}") from None
    return Override(op, key, value, text)


def parse_value(text: str) -> Any:
    """Parse one override value (see the module docstring for the grammar)."""
    stripped = text.strip()
    if not stripped:
        return ""
    if stripped[0] in "[{'\"":
        parser = _Parser(stripped)
        value = parser.element()
        parser.skip_ws()
        if parser.pos != len(stripped):
            raise ValueError(f"unexpected text after position {parser.pos}: {stripped[parser.pos:]!r}")
        return value
    return primitive(stripped)


def primitive(token: str) -> Any:
    """An unquoted token: null, bool, int, float, or the string itself."""
    low = token.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.match(token):
        return int(token.replace("_", ""))
    if _FLOAT.match(token):
        return float(token)
    return token


class _Parser:
    """Recursive descent over lists, dicts, quoted strings and unquoted tokens."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def element(self, stops: str = ",]}") -> Any:
        self.skip_ws()
        char = self.peek()
        if char == "[":
            return self.sequence()
        if char == "{":
            return self.mapping()
        if char in "'\"":
            return self.quoted()
        return primitive(self.unquoted(stops))

    def sequence(self) -> list:
        self.pos += 1
        items: list = []
        self.skip_ws()
        if self.peek() == "]":
            self.pos += 1
            return items
        while True:
            items.append(self.element())
            self.skip_ws()
            if self.expect(",]") == "]":
                return items

    def mapping(self) -> dict:
        self.pos += 1
        items: dict = {}
        self.skip_ws()
        if self.peek() == "}":
            self.pos += 1
            return items
        while True:
            self.skip_ws()
            key = self.quoted() if self.peek() in "'\"" else self.unquoted(":")
            self.skip_ws()
            self.expect(":")
            items[key] = self.element()
            self.skip_ws()
            if self.expect(",}") == "}":
                return items

    def expect(self, chars: str) -> str:
        char = self.peek()
        if not char or char not in chars:
            found = repr(char) if char else "the end"
            raise ValueError(f"expected one of {list(chars)} at position {self.pos}, found {found}")
        self.pos += 1
        return char

    def quoted(self) -> str:
        quote, out = self.text[self.pos], []
        self.pos += 1
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "\\" and self.pos + 1 < len(self.text) and self.text[self.pos + 1] in (quote, "\\"):
                out.append(self.text[self.pos + 1])
                self.pos += 2
                continue
            self.pos += 1
            if char == quote:
                return "".join(out)
            out.append(char)
        raise ValueError(f"unterminated {quote} quote")

    def unquoted(self, stops: str) -> str:
        # ${...} interpolations may hold commas and colons: skip them whole.
        start, depth = self.pos, 0
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "$" and self.text[self.pos + 1:self.pos + 2] == "{":
                depth += 1
                self.pos += 2
                continue
            if char == "}" and depth:
                depth -= 1
            elif depth == 0 and char in stops:
                break
            self.pos += 1
        token = self.text[start:self.pos].strip()
        if not token:
            raise ValueError(f"empty element at position {start}")
        return token

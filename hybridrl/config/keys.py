"""Key paths of the schema: lookup, defaults, type descriptions and close-match suggestions."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

from hybridrl.config.schema import HybridRLConfig


@dataclass(frozen=True)
class KeyInfo:
    """Where a key path lands. kind: section | leaf | extension (inside a dict-typed field) | unknown.

    For ``extension``, ``path`` is the dict field's path and ``rest`` the part below it.
    """

    kind: str
    path: str
    hint: Any = None
    field: dataclasses.Field | None = None
    rest: str = ""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def is_dict_hint(hint: Any) -> bool:
    return typing.get_origin(_strip_optional(hint)[0]) is dict


def is_str_tuple_hint(hint: Any) -> bool:
    inner = _strip_optional(hint)[0]
    return typing.get_origin(inner) is tuple and typing.get_args(inner)[:1] == (str,)


def lookup(path: str, root: type = HybridRLConfig) -> KeyInfo:
    """Resolve a dotted key path against the schema."""
    cls, parts = root, path.split(".")
    for index, name in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if name not in fields:
            return KeyInfo("unknown", path)
        hint = _hints(cls)[name]
        here = ".".join(parts[: index + 1])
        if is_dict_hint(hint):
            rest = ".".join(parts[index + 1:])
            return KeyInfo("extension" if rest else "leaf", here, hint, fields[name], rest)
        if dataclasses.is_dataclass(hint):
            cls = hint
            continue
        if index != len(parts) - 1:
            return KeyInfo("unknown", path)
        return KeyInfo("leaf", here, hint, fields[name])
    return KeyInfo("section", path, cls)


def field_default(info: KeyInfo) -> Any:
    """The schema default of a leaf or section (a fresh object for sections and dicts)."""
    if info.kind == "section":
        return info.hint()
    field = info.field
    assert field is not None
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


@functools.lru_cache(maxsize=4)
def all_keys(root: type = HybridRLConfig) -> tuple[str, ...]:
    """Every leaf key path of the schema rooted at ``root``, in declaration order."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for field in dataclasses.fields(cls):
            hint = _hints(cls)[field.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, prefix + field.name + ".")
            else:
                out.append(prefix + field.name)

    walk(root, "")
    return tuple(out)


def suggest(key: str, limit: int = 4, root: type = HybridRLConfig) -> list[str]:
    """Closest valid keys: by the whole path, then by the last name in other sections."""
    keys = all_keys(root)
    close = difflib.get_close_matches(key, keys, n=limit, cutoff=0.75)
    last = key.rsplit(".", 1)[-1]
    by_name = {k.rsplit(".", 1)[-1]: k for k in keys}
    for name in difflib.get_close_matches(last, list(by_name), n=limit, cutoff=0.8):
        close += [k for k in keys if k.rsplit(".", 1)[-1] == name and k not in close]
    return close[:limit]


def describe_type(hint: Any) -> str:
    """A human description of a field type, for error messages."""
    inner, optional = _strip_optional(hint)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            text = f"a list of {names.get(args[0], 'values').split(' ', 1)[-1]}s"
        else:
            text = f"a list of {len(args)} {names.get(args[0], 'values').split(' ', 1)[-1]}s"
    elif origin is dict:
        text = "a mapping {key: value}"
    else:
        text = names.get(inner, getattr(inner, "__name__", str(inner)))
    return text + (" or null" if optional else "")

"""``hybridrl config``: print or check a resolved config, or list every key.

    hybridrl config show  [--preset NAME|FILE] [overrides...]   resolved config as YAML
    hybridrl config check [--preset NAME|FILE] [overrides...]   validate only
    hybridrl config keys                                         every key, its default and help (Markdown)
"""

from __future__ import annotations

import dataclasses
import sys
import typing
import warnings

from hybridrl.config.errors import ConfigError
from hybridrl.config.loader import DEFAULT_PRESET, dump_config_yaml, list_presets, load_config
from hybridrl.config.schema import HybridRLConfig

USAGE = __doc__.split("\n", 2)[2]


def split_preset(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull ``--preset NAME`` / ``--preset=NAME`` (``none``: schema defaults) out of argv."""
    preset: str | None = DEFAULT_PRESET
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--preset":
            preset = next(args, None)
            if preset is None:
                raise ConfigError(f"--preset needs a value: one of {', '.join(list_presets())} or a YAML path")
        elif arg.startswith("--preset="):
            preset = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return (None if preset == "none" else preset), rest


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "keys":
        print(keys_markdown())
        return 0
    if command not in ("show", "check"):
        print(f"hybridrl config: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        preset, overrides = split_preset(rest)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config(overrides, preset=preset)
    except ConfigError as err:
        print(f"hybridrl config {command}: {err}", file=sys.stderr)
        return 1
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    if command == "show":
        print(dump_config_yaml(cfg), end="")
    else:
        print(f"config OK (preset {preset}, {len(overrides)} overrides, world size {cfg.trainer.world_size})")
    return 0


def keys_markdown() -> str:
    """One Markdown table per section: key, type, default, allowed values, help."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        rows, subsections = [], []
        for field in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[field.name]):
                subsections.append((hints[field.name], prefix + field.name))
                continue
            default = field.default_factory() if field.default is dataclasses.MISSING else field.default
            choices = " \\| ".join(field.metadata.get("choices", ()))
            rows.append(f"| `{prefix}{field.name}` | `{default!r}` | {choices} | {field.metadata['help']} |")
        if rows:
            out.append(f"\n### `{prefix.rstrip('.') or '(root)'}`\n\n| key | default | allowed | meaning |\n|---|---|---|---|")
            out.extend(rows)
        for sub_cls, path in subsections:
            walk(sub_cls, path + ".")

    walk(HybridRLConfig, "")
    return "\n".join(out).lstrip() + "\n"

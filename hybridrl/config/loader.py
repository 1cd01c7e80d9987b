"""Load a config: schema defaults <- preset YAML <- command-line overrides, then resolve and validate.

This is the only place a config is built or changed. Every key is checked against the schema as it
is applied; verl keys outside the schema go through ``verl_compat`` (renamed, no-op, or an error
saying why they are unsupported); anything else is an unknown key with the closest valid ones named.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config import keys as keyspace
from hybridrl.config import verl_compat
from hybridrl.config.errors import ConfigError, ConfigWarning
from hybridrl.config.overrides import Override, parse_override
from hybridrl.config.schema import HybridRLConfig
from hybridrl.config.validate import validate

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "ppo_trainer"

# (deprecated global key, per-device key it is folded into), all divided by the world size as verl does.
DEPRECATED_GLOBAL_MICRO = (
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    ("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu"),
    ("reward_model.micro_batch_size", "reward_model.micro_batch_size_per_gpu"),
)


@dataclasses.dataclass(frozen=True)
class Schema:
    """One family of configs the loader builds (the RL trainer's, the SFT trainer's, ...).

    root: the frozen root dataclass; its ``trainer`` section must have ``device``, ``nnodes``,
    ``n_gpus_per_node`` and ``n_cpu_workers`` (device resolution and world-size arithmetic).
    validate: ``cfg -> list of problems``. find_unsupported / renamed / aliases / unsupported_values:
    the verl keys and values outside ``root`` (see ``verl_compat``). global_micro: deprecated global
    micro-batch keys folded into per-device keys.
    """

    root: type
    validate: Callable[[Any], list[str]]
    find_unsupported: Callable[[str], verl_compat.Unsupported | None] = verl_compat.find_unsupported
    renamed: Mapping[str, str] = dataclasses.field(default_factory=lambda: verl_compat.RENAMED)
    aliases: Mapping[str, str] = dataclasses.field(default_factory=lambda: verl_compat.ALIASES)
    unsupported_values: Mapping[tuple[str, Any], str] = dataclasses.field(
        default_factory=lambda: verl_compat.UNSUPPORTED_VALUES)
    global_micro: tuple[tuple[str, str], ...] = DEPRECATED_GLOBAL_MICRO


RL_SCHEMA = Schema(HybridRLConfig, validate)


def load_config(
    overrides: Iterable[str] = (), preset: str | None = DEFAULT_PRESET, schema: Schema = RL_SCHEMA
) -> Any:
    """Build the validated, frozen config (a ``schema.root``; by default a ``HybridRLConfig``).

    Args:
        overrides: Hydra-style strings, applied in order after the preset (``a.b=1``, ``+a.b=1``,
            ``++a.b=1``, ``~a.b``).
        preset: a name in ``hybridrl/config/presets`` (without ``.yaml``), a path to a YAML file
            (e.g. a dumped ``config.yaml`` of a checkpoint), or None for the schema defaults.
        schema: which config family to build (``RL_SCHEMA``: the PPO/GRPO trainer's).

    Raises:
        ConfigError: listing every offending key with what is allowed.
    """
    tree = copy.deepcopy(_schema_tree(schema.root))
    errors: list[str] = []
    if preset is not None:
        path = preset_path(preset)
        for op in preset_overrides(path, schema.root):
            _apply(tree, op, errors, f"preset {path.name}", schema)
    for text in overrides:
        try:
            op = parse_override(text)
        except ConfigError as err:
            errors.append(str(err))
            continue
        _apply(tree, op, errors, "override", schema)
    _raise_if(errors)
    _resolve_device(tree)
    _fold_global_micro_batches(tree, errors, schema.global_micro)
    _raise_if(errors)
    cfg = _to_object(tree)
    _raise_if(schema.validate(cfg))
    return cfg


@functools.lru_cache(maxsize=4)
def _schema_tree(root: type) -> DictConfig:
    """The schema defaults as a writable OmegaConf tree; built once (slow), deep-copied per load (fast)."""
    return _unfrozen(OmegaConf.structured(root))


def _unfrozen(node: Any) -> Any:
    """OmegaConf marks every node of a frozen dataclass read-only; loading needs them writable.

    The returned config object is frozen again (dataclasses.FrozenInstanceError on assignment).
    """
    node._set_flag("readonly", None)
    if isinstance(node, (DictConfig, ListConfig)):
        for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
            child = node._get_node(key)
            if child is not None:
                _unfrozen(child)
    return node


def preset_path(preset: str) -> Path:
    """A preset name or a YAML path -> the file; unknown names list the available presets."""
    if preset.endswith((".yaml", ".yml")) or "/" in preset:
        path = Path(preset).expanduser()
    else:
        path = PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ConfigError(f"preset {preset!r}: no file {path}; available presets: {', '.join(list_presets())} "
                          "(or give a path to a YAML file)")
    return path


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_overrides(path: Path, root: type = HybridRLConfig) -> list[Override]:
    """The leaves of a preset YAML as ``++key=value`` operations (a preset may fill extension dicts)."""
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OSError, OmegaConfBaseException, ValueError) as err:
        raise ConfigError(f"preset {path}: cannot read it as YAML: {err}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"preset {path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return [Override("force", key, value, f"{key}: {value!r}") for key, value in _flatten(data, "", root)]


def _flatten(data: dict, prefix: str, root: type) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, value in data.items():
        key = f"{prefix}{name}"
        info = keyspace.lookup(key, root)
        if isinstance(value, dict) and value and info.kind not in ("leaf", "extension"):
            out += _flatten(value, key + ".", root)
        else:
            out.append((key, value))
    return out


def _raise_if(errors: list[str]) -> None:
    if errors:
        head = "invalid config" if len(errors) == 1 else f"invalid config ({len(errors)} problems)"
        raise ConfigError(head + ":\n  - " + "\n  - ".join(errors))


# --------------------------------------------------------------------------------------- applying ops
def _apply(tree: DictConfig, op: Override, errors: list[str], origin: str, schema: Schema = RL_SCHEMA) -> None:
    """Apply one operation, appending a message to ``errors`` instead of raising."""
    key = op.key
    if key in schema.renamed:
        new = schema.renamed[key]
        warnings.warn(f"{origin} {op.text!r}: {key} was renamed in verl to {new}; using {new}", ConfigWarning, stacklevel=3)
        key = new
    key = schema.aliases.get(key, key)
    info = keyspace.lookup(key, schema.root)
    if info.kind == "section" and isinstance(op.value, dict):
        for sub_key, sub_value in _flatten(op.value, key + ".", schema.root):
            _apply(tree, dataclasses.replace(op, key=sub_key, value=sub_value), errors, origin, schema)
        return
    if info.kind == "unknown":
        _apply_outside_schema(op, key, errors, origin, schema)
    elif info.kind == "extension":
        _apply_extension(tree, op, key, errors, origin)
    elif op.op == "delete":
        _reset(tree, op, key, info, errors, origin, schema)
    else:
        _set(tree, key, op.value, info, errors, origin, op.text, schema)


def _set(tree: DictConfig, key: str, value: Any, info: keyspace.KeyInfo, errors: list[str], origin: str, text: str,
         schema: Schema = RL_SCHEMA) -> None:
    bad_value = schema.unsupported_values.get((key, value)) if isinstance(value, str) else None
    if bad_value:
        errors.append(f"{origin} {text!r}: {key}={value} is not supported: {bad_value}")
        return
    if info.kind == "leaf" and isinstance(value, str) and keyspace.is_str_tuple_hint(info.hint) and "${" not in value:
        value = [value]  # verl accepts a single path/logger where a list is expected
    choices = info.field.metadata.get("choices") if info.field is not None else None
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    bad = [v for v in items if choices and v is not None and not (isinstance(v, str) and "${" in v) and v not in choices]
    if bad:
        errors.append(f"{origin} {text!r}: {key}={bad[0]!r} is not allowed; choose from {', '.join(choices)}")
        return
    try:
        OmegaConf.update(tree, key, value, merge=False)
    except (OmegaConfBaseException, ValueError, TypeError) as err:
        expected = keyspace.describe_type(info.hint) if info.kind == "leaf" else "a mapping of its keys"
        detail = str(err).splitlines()[0]
        errors.append(f"{origin} {text!r}: {key} must be {expected}, got {value!r} ({detail})")


def _reset(tree: DictConfig, op: Override, key: str, info: keyspace.KeyInfo, errors: list[str], origin: str,
           schema: Schema = RL_SCHEMA) -> None:
    """``~key`` on a schema key puts back its schema default (schema keys cannot be removed)."""
    if op.has_value and OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(tree, key)}))["v"] != op.value:
        errors.append(f"{origin} {op.text!r}: {key} is not {op.value!r}; ~key=value deletes only a matching value")
        return
    default = keyspace.field_default(info)
    if dataclasses.is_dataclass(default):
        default = _unfrozen(OmegaConf.structured(default))
    _set(tree, key, default, info, errors, origin, op.text, schema)


def _apply_extension(tree: DictConfig, op: Override, key: str, errors: list[str], origin: str) -> None:
    """Entries of dict-typed fields (override_config, reward_kwargs, ...): Hydra's add/set/delete rules."""
    exists = OmegaConf.select(tree, key, default=_ABSENT) is not _ABSENT
    if op.op == "add" and exists:
        errors.append(f"{origin} {op.text!r}: {key} is already set; use {key}=VALUE or ++{key}=VALUE to change it")
    elif op.op == "set" and not exists:
        errors.append(f"{origin} {op.text!r}: {key} is not set; add it with +{key}=VALUE")
    elif op.op == "delete":
        if not exists:
            errors.append(f"{origin} {op.text!r}: {key} is not set, nothing to delete")
            return
        parent, _, name = key.rpartition(".")
        del OmegaConf.select(tree, parent)[name]
    else:
        try:
            OmegaConf.update(tree, key, op.value, merge=False, force_add=True)
        except (OmegaConfBaseException, ValueError, TypeError) as err:
            errors.append(f"{origin} {op.text!r}: cannot set {key}: {str(err).splitlines()[0]}")


_ABSENT = object()


def _apply_outside_schema(op: Override, key: str, errors: list[str], origin: str, schema: Schema = RL_SCHEMA) -> None:
    """verl keys hybridrl does not have: accepted when they switch the feature off, else an error."""
    if isinstance(op.value, dict) and op.value:
        for sub_key, sub_value in _flatten(op.value, key + ".", schema.root):
            _apply_outside_schema(dataclasses.replace(op, key=sub_key, value=sub_value), sub_key, errors, origin, schema)
        return
    entry = schema.find_unsupported(key)
    if entry is None:
        close = keyspace.suggest(key, root=schema.root)
        hint = f"; did you mean {', '.join(close)}?" if close else "; run `hybridrl config show` to list the keys"
        errors.append(f"{origin} {op.text!r}: unknown key {key}{hint}")
    elif op.op == "delete" or verl_compat.is_noop(entry, op.value):
        if entry.accepts == verl_compat.WARN and not verl_compat.is_empty(op.value):
            warnings.warn(f"{origin} {op.text!r}: {key} has no effect in hybridrl: {entry.reason}", ConfigWarning, stacklevel=4)
    elif entry.otherwise == verl_compat.WARN:
        warnings.warn(f"{origin} {op.text!r}: {key}={op.value!r} has no effect in hybridrl: {entry.reason}",
                      ConfigWarning, stacklevel=4)
    else:
        allowed = "" if entry.accepts == verl_compat.NEVER else f" (only {' or '.join(map(repr, entry.accepts))} is accepted)"
        errors.append(f"{origin} {op.text!r}: {key} is not supported by hybridrl: {entry.reason}{allowed}")


# -------------------------------------------------------------------------------------- normalizing
def _resolve_device(tree: DictConfig) -> None:
    """trainer.device=auto becomes cuda or cpu here, so the batch arithmetic uses the real world size."""
    if tree.trainer.device == "auto":
        import torch  # deferred: only configs that ask for auto detection pay for the import

        tree.trainer.device = "cuda" if torch.cuda.is_available() else "cpu"


def _world_size(tree: DictConfig) -> int:
    trainer = tree.trainer
    per_node = trainer.n_gpus_per_node if trainer.device == "cuda" else trainer.n_cpu_workers
    return int(trainer.nnodes) * int(per_node)


def _fold_global_micro_batches(
    tree: DictConfig, errors: list[str], pairs: tuple[tuple[str, str], ...] = DEPRECATED_GLOBAL_MICRO
) -> None:
    """verl's deprecated global micro batch sizes are divided by the world size (verl does the same)."""
    world = _world_size(tree)
    for global_key, per_gpu_key in pairs:
        total, per_gpu = OmegaConf.select(tree, global_key), OmegaConf.select(tree, per_gpu_key)
        if total is None:
            continue
        if per_gpu is not None:
            errors.append(f"{global_key}={total} and {per_gpu_key}={per_gpu} are both set; remove {global_key} "
                          "(deprecated: a global size divided by the world size)")
        elif world <= 0 or total % world:
            errors.append(f"{global_key}={total} must be a multiple of the world size {world} "
                          f"(trainer.nnodes x devices per node); {total} / {world} is not an integer. "
                          f"Set {per_gpu_key} instead")
        else:
            OmegaConf.update(tree, per_gpu_key, total // world, merge=False)
            OmegaConf.update(tree, global_key, None, merge=False)  # folded: downstream reads *_per_gpu only


def _to_object(tree: DictConfig) -> Any:
    try:
        return OmegaConf.to_object(tree)
    except OmegaConfBaseException as err:
        lines = str(err).splitlines()
        key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.strip().startswith("full_key:")), "?")
        raise ConfigError(f"invalid config:\n  - {key}: {lines[0]}") from None


# ---------------------------------------------------------------------------------------- exporting
def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (lists for tuples) of a resolved config, ready for YAML/JSON."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(cfg))


def dump_config_yaml(cfg: Any, path: str | Path | None = None) -> str:
    """The resolved config as YAML (written to ``path`` if given); ``load_config(preset=path)`` reloads it
    (with the same ``schema``)."""
    text = OmegaConf.to_yaml(OmegaConf.create(config_to_dict(cfg)))
    if path is not None:
        Path(path).write_text(text)
    return text

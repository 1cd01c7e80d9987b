"""Merging sharded engine checkpoints into Hugging Face folders.

Checkpoint layout (one role, e.g. ``global_step_N/actor``)::

    model_optim/        torch.distributed.checkpoint (DCP) shards of model + optimizer, any world size
    engine_meta.json    world size and step (written by hybridrl.engine.checkpoint)
    huggingface/        config.json, generation_config.json, tokenizer files (save_checkpoint_metadata)

The model entries of the DCP state dict are full-model names (``model.layers.0...``, or
``backbone.* / value_head.*`` for a critic); DCP reassembles each tensor from however many ranks
wrote it, so merging never needs the training world size.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from hybridrl.models.critic import CriticModel, load_critic, save_critic
from hybridrl.models.loading import load_causal_lm, to_torch_dtype

HF_SUBDIR = "huggingface"
MODEL_OPTIM = "model_optim"
CRITIC_HEAD_KEYS = ("value_head.weight", "value_head.bias")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class Mismatch:
    """One tensor that differs between a merged checkpoint and a reference folder.

    kind: ``missing_in_reference`` | ``missing_in_checkpoint`` | ``shape`` | ``value``."""

    name: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.kind} ({self.detail})"


# --------------------------------------------------------------------------- writing (workers)
def save_checkpoint_metadata(ckpt_dir: str | os.PathLike, model: nn.Module, tokenizer=None) -> Path:
    """Write ``<ckpt_dir>/huggingface/`` (config, generation config, tokenizer) beside the shards.

    Call it on ONE rank (rank 0) after ``TrainEngine.save_checkpoint``. ``model`` is the engine's
    model (FSDP-wrapped or not; only ``.config`` / ``.generation_config`` are read); for a critic its
    ``.config`` is the backbone's. With this a checkpoint merges without the original model folder."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"save_checkpoint_metadata: {type(model).__name__} has no .config (not a HF model)")
    out = Path(ckpt_dir) / HF_SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------ reading
def is_engine_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` holds a TrainEngine checkpoint (a ``model_optim/`` DCP folder)."""
    return (Path(path) / MODEL_OPTIM).is_dir()


def find_checkpoint_dir(path: str | os.PathLike, role: str = "actor") -> Path:
    """``path`` if it is a role checkpoint, else ``path/<role>`` (e.g. a ``global_step_N`` folder)."""
    path = Path(path)
    for candidate in (path, path / role):
        if is_engine_checkpoint(candidate):
            return candidate
    raise FileNotFoundError(
        f"{path} is not a checkpoint: neither {path / MODEL_OPTIM} nor {path / role / MODEL_OPTIM} exists; "
        f"pass <default_local_dir>/global_step_<N>/{role}"
    )


def load_model_state(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Full model tensors (name -> CPU tensor, stored dtype) of a checkpoint, without the optimizer.

    Reads the DCP metadata, allocates one empty tensor per model entry and lets DCP fill them from
    the shards of every rank (works for any saving world size, in a single process)."""
    dcp_dir = Path(ckpt_dir) / MODEL_OPTIM
    if not dcp_dir.is_dir():
        raise FileNotFoundError(f"{ckpt_dir} is not an engine checkpoint: {dcp_dir} is missing")
    metadata = FileSystemReader(str(dcp_dir)).read_metadata()
    paths = metadata.planner_data or {}
    state: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        path = paths.get(key, ())
        if len(path) == 2 and path[0] == "model" and isinstance(entry, TensorStorageMetadata):
            state[path[1]] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not state:
        raise ValueError(f"{dcp_dir}: the checkpoint holds no model tensors (keys: {list(paths)[:5]} ...)")
    with _quiet_single_process():
        dcp.load({"model": state}, checkpoint_id=str(dcp_dir), no_dist=True)
    return state


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes a single process even when ``no_dist=True`` says so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)
        yield


def is_critic_state(state: dict[str, torch.Tensor]) -> bool:
    """A critic checkpoint has ``value_head.*`` and ``backbone.*`` entries."""
    return all(k in state for k in CRITIC_HEAD_KEYS) and any(k.startswith("backbone.") for k in state)


def _config_dir(ckpt_dir: Path, hf_config_dir: str | os.PathLike | None) -> Path:
    folder = Path(hf_config_dir) if hf_config_dir is not None else ckpt_dir / HF_SUBDIR
    if not (folder / "config.json").is_file():
        hint = "" if hf_config_dir is not None else (
            f"; the checkpoint has no {HF_SUBDIR}/ (it predates config saving): pass --hf_model_path "
            "<the model folder the run started from>")
        raise FileNotFoundError(f"no config.json in {folder}{hint}")
    return folder


def _build_model(state: dict[str, torch.Tensor], config) -> nn.Module:
    """The HF causal LM or CriticModel holding ``state`` (parameters on CPU; built on the meta
    device first, so no random init. Non-persistent buffers stay on meta: save it, do not run it)."""
    critic = is_critic_state(state)
    with torch.device("meta"):
        model = AutoModel.from_config(config) if critic else AutoModelForCausalLM.from_config(config)
    if critic:
        backbone_state = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
        _assign(model, backbone_state, "backbone")
        head = nn.Linear(config.hidden_size, 1, dtype=state["value_head.weight"].dtype)
        _assign(head, {k.removeprefix("value_head."): state[k] for k in CRITIC_HEAD_KEYS}, "value_head")
        return CriticModel(model, head)
    _assign(model, state, "model")
    model.tie_weights()  # re-ties lm_head to the embedding when the config says so (loaded as two tensors)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"checkpoint lacks tensors {left[:8]} and the config does not tie them to others")
    return model


def _assign(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    result = module.load_state_dict(state, strict=False, assign=True)
    # a tied lm_head.weight may be absent; _build_model re-ties it and checks nothing is left unset
    missing = [k for k in result.missing_keys if not k.endswith("lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint tensors do not fit the {what} built from its config: missing {missing[:8]}, "
            f"unexpected {result.unexpected_keys[:8]}; is huggingface/config.json the model that was trained?"
        )


def load_merged(ckpt_dir: str | os.PathLike, hf_config_dir: str | os.PathLike | None = None,
                dtype: str | torch.dtype | None = None) -> tuple[nn.Module, Path]:
    """(model with the checkpoint's weights, folder its config came from); see ``_build_model``."""
    ckpt_dir = Path(ckpt_dir)
    config_dir = _config_dir(ckpt_dir, hf_config_dir)
    state = load_model_state(ckpt_dir)
    if dtype is not None:
        torch_dtype = to_torch_dtype(dtype)
        state = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in state.items()}
    config = AutoConfig.from_pretrained(config_dir)
    return _build_model(state, config), config_dir


def load_merged_model(ckpt_dir: str | os.PathLike, hf_config_dir: str | os.PathLike | None = None) -> nn.Module:
    """The checkpoint's weights as a state-dict-ready module (for comparisons; to run it, merge to a
    folder and load that, as non-persistent buffers such as rotary tables are not materialised)."""
    return load_merged(ckpt_dir, hf_config_dir)[0]


# ------------------------------------------------------------------------------------- merging
def merge_checkpoint(local_dir: str | os.PathLike, target_dir: str | os.PathLike,
                     hf_config_dir: str | os.PathLike | None = None,
                     dtype: str | torch.dtype | None = None) -> Path:
    """Write ``target_dir`` as a HF folder: a causal LM (``from_pretrained`` loads it as is) or a
    critic (``hybridrl.models.load_critic`` loads it, value head included), plus the tokenizer
    when the checkpoint (or ``hf_config_dir``) has one. ``dtype`` casts floating tensors."""
    model, config_dir = load_merged(local_dir, hf_config_dir, dtype)
    tokenizer = _load_tokenizer(config_dir)
    target = Path(target_dir)
    if isinstance(model, CriticModel):
        save_critic(model, target, tokenizer)
    else:
        target.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(target)
        if tokenizer is not None:
            tokenizer.save_pretrained(target)
    return target


def _load_tokenizer(folder: Path):
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        warnings.warn(f"{folder} has no tokenizer files; the merged folder will lack a tokenizer", stacklevel=3)
        return None
    return AutoTokenizer.from_pretrained(folder)


def checkpoint_summary(ckpt_dir: str | os.PathLike) -> dict:
    """``engine_meta.json`` (saving world size, step), or {} when absent."""
    meta = Path(ckpt_dir) / "engine_meta.json"
    return json.loads(meta.read_text()) if meta.is_file() else {}


# ----------------------------------------------------------------------------------- comparing
def compare_state_dicts(merged: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                        rtol: float = 1e-5, atol: float = 1e-6) -> list[Mismatch]:
    """Every key missing on one side, differing in shape, or with ``|a - b| > atol + rtol * |b|``
    somewhere (compared in float32; the detail gives the max abs difference and where)."""
    out = [Mismatch(k, "missing_in_reference", f"shape {tuple(merged[k].shape)}") for k in sorted(set(merged) - set(reference))]
    out += [Mismatch(k, "missing_in_checkpoint", f"shape {tuple(reference[k].shape)}")
            for k in sorted(set(reference) - set(merged))]
    for name in sorted(set(merged) & set(reference)):
        a, b = merged[name].detach().float().cpu(), reference[name].detach().float().cpu()
        if a.shape != b.shape:
            out.append(Mismatch(name, "shape", f"checkpoint {tuple(a.shape)} vs reference {tuple(b.shape)}"))
            continue
        diff = (a - b).abs()
        bad = diff > atol + rtol * b.abs()
        if bool(bad.any()):
            worst = int(diff.argmax())
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
            out.append(Mismatch(name, "value", f"{int(bad.sum())}/{a.numel()} elements off, max |diff| "
                                               f"{float(diff.max()):.3g} at {index}"))
    return out


def compare_with_reference(local_dir: str | os.PathLike, test_hf_dir: str | os.PathLike,
                           hf_config_dir: str | os.PathLike | None = None,
                           rtol: float = 1e-5, atol: float = 1e-6) -> list[Mismatch]:
    """Mismatches between a checkpoint and a reference HF folder (a causal LM, or a critic folder
    when the checkpoint is a critic's); an empty list means they agree within tolerance."""
    merged = load_merged_model(local_dir, hf_config_dir)
    if isinstance(merged, CriticModel):
        reference = load_critic(test_hf_dir)
    else:
        reference = load_causal_lm(test_hf_dir)
    return compare_state_dicts(merged.state_dict(), reference.state_dict(), rtol=rtol, atol=atol)

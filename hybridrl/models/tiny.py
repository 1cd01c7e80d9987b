"""Built-in tiny causal LMs (Qwen2 or Llama) made from a config, offline and deterministically.

``make_tiny_model_dir`` writes an ordinary Hugging Face folder (config.json, model.safetensors,
generation_config.json, tokenizer files) that ``AutoModelForCausalLM.from_pretrained`` loads. Same
(preset, arch, seed) on the same torch/transformers versions -> identical bytes. The folder carries a
fingerprint file, so a second call with the same arguments returns at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen2Config

from hybridrl.models.tiny_tokenizer import build_tiny_tokenizer
from hybridrl.models.utils import count_parameters, models_dir, publish_dir, refuse_foreign_dir, staging_dir

FINGERPRINT_FILE = "hybridrl_tiny.json"
# Bump when the corpus, tokenizer or model recipe changes so stale caches are rebuilt.
RECIPE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TinyPreset:
    """Shape of one built-in model; the parameter count (tied embeddings, vocab 1024) is in the doc."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048


# Parameter counts with the 1024-token tiny tokenizer and tied embeddings (Qwen2 adds q/k/v biases).
PRESETS: dict[str, TinyPreset] = {
    "tiny": TinyPreset(128, 3, 4, 2, 384),  # ~0.72M
    "small": TinyPreset(256, 5, 8, 4, 768),  # ~4.2M
    "25m": TinyPreset(512, 8, 8, 4, 1536),  # ~25.7M
}
ARCHS = ("qwen2", "llama")


def tiny_config(preset: str = "tiny", arch: str = "qwen2", vocab_size: int = 1024) -> PretrainedConfig:
    """HF config for a preset; token ids match the tiny tokenizer (pad 0, eos ``<|im_end|>`` 2)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; allowed: {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny model arch {arch!r}; allowed: {list(ARCHS)}")
    cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    return cls(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
        **dataclasses.asdict(PRESETS[preset]),
    )


def build_tiny_model(preset: str = "tiny", arch: str = "qwen2", seed: int = 0) -> PreTrainedModel:
    """Randomly initialised fp32 model; the global torch RNG is restored afterwards."""
    config = tiny_config(preset, arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model.eval()


def preset_num_params(preset: str = "tiny", arch: str = "qwen2") -> int:
    """Parameter count of a preset (tied embeddings counted once), computed on the meta device: no memory."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(preset, arch))
    return count_parameters(model)


def _fingerprint(preset: str, arch: str, seed: int) -> dict:
    spec = {
        "recipe_version": RECIPE_VERSION,
        "preset": preset,
        "arch": arch,
        "seed": seed,
        "shape": dataclasses.asdict(PRESETS[preset]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    spec["digest"] = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return spec


def _is_built(out: Path, fingerprint: dict) -> bool:
    marker = out / FINGERPRINT_FILE
    if not (marker.is_file() and (out / "model.safetensors").is_file()):
        return False
    return json.loads(marker.read_text()).get("digest") == fingerprint["digest"]


def default_tiny_dir(preset: str = "tiny", arch: str = "qwen2", seed: int = 0) -> Path:
    """Cache location of a built-in model: ``models_dir()/tiny-<arch>-<preset>-s<seed>``."""
    return models_dir() / f"tiny-{arch}-{preset}-s{seed}"


def make_tiny_model_dir(
    out_dir: str | os.PathLike | None = None, preset: str = "tiny", arch: str = "qwen2", seed: int = 0
) -> Path:
    """Write (or reuse) a HF folder with a tiny model and the tiny tokenizer; returns its path.

    ``out_dir=None`` uses ``default_tiny_dir``. The folder is built in a temporary sibling and renamed
    into place, so concurrent callers (parallel tests) never see a half-written folder. An existing
    ``out_dir`` without our fingerprint file and not empty is refused rather than overwritten.
    """
    tiny_config(preset, arch)  # validates preset and arch before touching the disk
    out = Path(out_dir) if out_dir is not None else default_tiny_dir(preset, arch, seed)
    fingerprint = _fingerprint(preset, arch, seed)
    if _is_built(out, fingerprint):
        return out
    refuse_foreign_dir(out, FINGERPRINT_FILE)
    with staging_dir(out) as tmp:
        build_tiny_model(preset, arch, seed).save_pretrained(tmp)
        build_tiny_tokenizer().save_pretrained(tmp)
        (tmp / FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
        publish_dir(tmp, out, lambda: _is_built(out, fingerprint))
    return out

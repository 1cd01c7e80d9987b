"""Loading local HF folders, path errors, and the small helpers (position ids, parameter counts)."""

import pytest
import torch
from torch import nn

from hybridrl.models import compute_position_ids, count_parameters, load_causal_lm, load_tokenizer
from hybridrl.models.tiny_tokenizer import build_tiny_tokenizer


def test_compute_position_ids_left_and_right_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 1, 2, 3, 4]])
    assert torch.equal(compute_position_ids(mask), expected)
    assert torch.equal(compute_position_ids(mask.bool()), expected)


def test_count_parameters_counts_tied_weights_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "extra": nn.Linear(4, 2)})
    assert count_parameters(model) == 40 + 4 * 2 + 2
    model["extra"].requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 40


@pytest.mark.component
def test_load_causal_lm_options(tiny_dir):
    model = load_causal_lm(tiny_dir, dtype="bf16", attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert not model.training
    over = load_causal_lm(tiny_dir, override_config={"attention_dropout": 0.1})
    assert over.config.attention_dropout == 0.1
    ckpt = load_causal_lm(tiny_dir, gradient_checkpointing=True)
    assert ckpt.model.gradient_checkpointing and ckpt.config.use_cache is False


@pytest.mark.component
def test_hub_kernels_are_off_and_mode_switches_keep_patched_forwards(tiny_dir):
    """transformers 5 kernelizes a loaded model (its dependency ``kernels`` installed) and again on
    every train() / eval(), which put the class's forward back on the norms hybridrl gives its own;
    the loader turns that off, so the forwards stay across mode switches."""
    from hybridrl.engine import cpu_attention
    from hybridrl.engine.cpu_layers import use_cpu_layers

    model = load_causal_lm(tiny_dir)
    assert not getattr(model, "use_kernels", False)
    if not cpu_attention.available():
        pytest.skip("CPU kernels not built here")
    assert use_cpu_layers(model)["norm"] > 0
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for _ in range(2):
        model.train()
        model.eval()
    assert all("forward" in vars(m) for m in norms)


@pytest.mark.component
def test_sdpa_and_eager_agree(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    batch = tok(["What is 2+3?", "1 2 3 4 5 6 7 8"], return_tensors="pt", padding=True)
    batch["position_ids"] = compute_position_ids(batch["attention_mask"])
    with torch.no_grad():
        sdpa = load_causal_lm(tiny_dir, attn_implementation="sdpa")(**batch).logits
        eager = load_causal_lm(tiny_dir, attn_implementation="eager")(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(sdpa[real], eager[real], atol=1e-5, rtol=1e-4)


def test_bad_arguments_are_errors(tiny_dir):
    with pytest.raises(KeyError, match="'no_such_field'"):
        load_causal_lm(tiny_dir, override_config={"no_such_field": 1})
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_causal_lm(tiny_dir, dtype="float8")
    with pytest.raises(ValueError, match="attn_implementation"):
        load_causal_lm(tiny_dir, attn_implementation="flash_attention_9")


def test_missing_paths_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="Hugging Face Hub id") as err:
        load_causal_lm("Qwen/Qwen2.5-0.5B-Instruct")
    assert "'Qwen/Qwen2.5-0.5B-Instruct'" in str(err.value)
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        load_tokenizer(missing)
    assert str(missing) in str(err.value) and "Hub id" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_causal_lm(tmp_path / "empty")


def test_load_tokenizer_adds_pad_from_eos(tmp_path):
    tok = build_tiny_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == "<|im_end|>" and loaded.pad_token_id == loaded.eos_token_id

"""Built-in tiny models: presets, deterministic init, cached HF folders that reload exactly."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM

from hybridrl.models import build_tiny_model, default_tiny_dir, make_tiny_model_dir
from hybridrl.models.tiny import FINGERPRINT_FILE, preset_num_params

pytestmark = pytest.mark.component


@pytest.mark.parametrize(
    ("preset", "low", "high"), [("tiny", 0.5e6, 1.0e6), ("small", 4.0e6, 5.0e6), ("25m", 24e6, 27e6)]
)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_preset_sizes(preset, low, high, arch):
    assert low <= preset_num_params(preset, arch) <= high


def test_unknown_preset_and_arch_are_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown tiny model preset 'huge'.*'25m', 'small', 'tiny'"):
        make_tiny_model_dir(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError, match=r"unknown tiny model arch 'gpt2'"):
        build_tiny_model("tiny", arch="gpt2")


def test_same_seed_same_weights_and_rng_untouched():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model(seed=7).state_dict()
    assert torch.equal(torch.rand(3), expected_next)  # building does not consume the caller's RNG
    b = build_tiny_model(seed=7).state_dict()
    c = build_tiny_model(seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"]
    )


def test_folder_reloads_with_identical_logits(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert isinstance(model, Qwen2ForCausalLM) and model.dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    ids = tok(["What is 12 + 30?", "Sort the list [3, 1]"], return_tensors="pt", padding=True)
    with torch.no_grad():
        got = model(**ids).logits
        want = build_tiny_model(seed=0)(**ids).logits
    assert got.shape == (2, ids["input_ids"].shape[1], len(tok))
    assert torch.equal(got, want)


def test_llama_arch_folder(tmp_path):
    out = make_tiny_model_dir(tmp_path / "llama", arch="llama", seed=3)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, LlamaForCausalLM)
    want = build_tiny_model(arch="llama", seed=3).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_identical_bytes_and_cached_second_call(tmp_path, tiny_dir):
    again = make_tiny_model_dir(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", FINGERPRINT_FILE):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes()
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model_dir(again) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime  # not rewritten


def test_stale_fingerprint_is_rebuilt(tmp_path):
    out = make_tiny_model_dir(tmp_path / "m", seed=0)
    marker = json.loads((out / FINGERPRINT_FILE).read_text())
    marker["digest"] = "stale"
    (out / FINGERPRINT_FILE).write_text(json.dumps(marker))
    make_tiny_model_dir(out, seed=0)
    assert json.loads((out / FINGERPRINT_FILE).read_text())["digest"] != "stale"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_foreign_folder_is_not_overwritten(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        make_tiny_model_dir(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_default_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_MODELS_DIR", str(tmp_path))
    assert default_tiny_dir("small", "llama", 2) == tmp_path / "tiny-llama-small-s2"
    assert make_tiny_model_dir() == tmp_path / "tiny-qwen2-tiny-s0"

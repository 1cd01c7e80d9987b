"""Memory preflight: parameter counts match real models; a run that cannot fit is refused naming the knob."""

from __future__ import annotations

import pytest
from reliability_helpers import config
from transformers import AutoModelForCausalLM, LlamaConfig

from hybridrl.models.tiny import PRESETS, preset_num_params, tiny_config
from hybridrl.utils.preflight import GiB, PreflightError, check_memory, estimate, read_model_shape


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_count_matches_the_model(tmp_path, arch, preset):
    tiny_config(preset, arch).save_pretrained(tmp_path)
    assert read_model_shape(str(tmp_path)).num_params == preset_num_params(preset, arch)


def test_untied_llama_with_attention_bias(tmp_path):
    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    cfg.save_pretrained(tmp_path)
    with __import__("torch").device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert read_model_shape(str(tmp_path)).num_params == real


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("preflight_model")
    tiny_config("tiny").save_pretrained(path)
    return {"model": str(path), "train": "unused.parquet", "test": "unused.parquet"}


def test_small_run_fits_and_terms_scale_as_documented(model_dir, tmp_path):
    cfg = config(model_dir, tmp_path)
    est = check_memory(cfg, available_host=8 * GiB)
    n = read_model_shape(model_dir["model"]).num_params
    assert est.terms["actor parameters, gradients, optimizer"] == 16 * n / 2  # fp32 + grad + AdamW over 2 ranks
    assert est.terms["reference parameters"] == 4 * n / 2
    # logits: 3 x micro-batch (2) x R (8) x V (1024) x 4 bytes
    assert est.terms["actor logits"] == 3 * 2 * 8 * 1024 * 4
    assert est.host_total < 8 * GiB
    assert "reward model parameters" not in est.terms
    with_rm = check_memory(config(model_dir, tmp_path, **{"reward_model.enable": True, "data.return_raw_chat": True,
                                                           "reward_model.micro_batch_size_per_gpu": 4,
                                                           "reward_model.model.path": model_dir["model"]}),
                           available_host=8 * GiB)
    assert with_rm.terms["reward model parameters"] == 4 * n / 2


def test_run_that_cannot_fit_is_refused_naming_the_knob(model_dir, tmp_path, capsys):
    cfg = config(model_dir, tmp_path, **{"data.train_batch_size": 4096, "actor_rollout_ref.rollout.n": 16,
                                         "data.max_response_length": 512})
    assert max(estimate(cfg).terms, key=estimate(cfg).terms.get) == "rollout KV cache"
    with pytest.raises(PreflightError) as info:
        check_memory(cfg, available_host=2 * GiB)
    text = str(info.value)
    assert "host memory: needs about" in text and "2.0 GiB available" in text
    assert "turn first: data.train_batch_size (now 4096), actor_rollout_ref.rollout.n (now 16)" in text
    warn = config(model_dir, tmp_path, **{"data.train_batch_size": 4096, "actor_rollout_ref.rollout.n": 16,
                                          "data.max_response_length": 512, "trainer.preflight": "warn"})
    check_memory(warn, available_host=2 * GiB)
    assert "warning: memory preflight" in capsys.readouterr().err


def test_model_folder_without_config_is_named(tmp_path):
    with pytest.raises(PreflightError, match=r"config.json not found"):
        read_model_shape(str(tmp_path))

"""RolloutWorker with the native engine: the cache it frees between rollouts (free_cache_engine)."""

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.models import load_tokenizer, make_tiny_model_dir
from hybridrl.protocol import DataProto
from hybridrl.workers.rollout import RolloutWorker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", preset="tiny")


def prompts(model_dir, rows: int = 2, width: int = 12) -> DataProto:
    tok = load_tokenizer(str(model_dir))
    ids = torch.randint(3, tok.vocab_size, (rows, width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": mask.cumsum(-1) - 1})
    data.meta_info = {"global_step": 1}
    return data


@pytest.mark.parametrize("free", [True, False])
def test_native_rollout_frees_its_cache_after_each_generation(model_dir, free, monkeypatch):
    config = load_config([f"actor_rollout_ref.model.path={model_dir}", "data.max_response_length=8",
                          f"actor_rollout_ref.rollout.free_cache_engine={free}"],
                         preset="grpo_quickstart")
    worker = RolloutWorker(config)
    decoder = worker.engine.decoder
    repacks = []
    repack = decoder._repack
    monkeypatch.setattr(decoder, "_repack", lambda *args: repacks.append(args) or repack(*args))
    first = worker.generate_sequences(prompts(model_dir))
    assert first.batch["responses"].shape == (2 * config.actor_rollout_ref.rollout.n, 8)
    # freed: no KV buffer and no packed weights held through the update; kept otherwise. Whether the
    # decode steps pack at all depends on the build and the matmul backend (a build without the
    # matmul kernel, where oneDNN is the backend, runs oneDNN's plain products and packs nothing)
    assert (decoder.cache.buffer is None) == free
    assert decoder.packed_rows == 0 if free else (decoder.packed_rows > 0) == bool(repacks)
    again = worker.generate_sequences(prompts(model_dir))  # reallocates and repacks as needed
    assert torch.equal(again.batch["responses"], first.batch["responses"])  # same seed, same step


def test_the_worker_builds_the_kv_cache_dtype_it_is_given(model_dir):
    from hybridrl.rollout import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None or not kernels.kv_half_supported:
        pytest.skip("a float16 KV cache needs the CPU kernels with F16C conversions")
    config = load_config([f"actor_rollout_ref.model.path={model_dir}", "data.max_response_length=8",
                          "actor_rollout_ref.rollout.kv_cache_dtype=float16",
                          "actor_rollout_ref.rollout.free_cache_engine=false"], preset="grpo_quickstart")
    worker = RolloutWorker(config)
    out = worker.generate_sequences(prompts(model_dir))
    assert out.batch["responses"].shape == (2 * config.actor_rollout_ref.rollout.n, 8)
    assert worker.engine.decoder.cache.buffer.dtype == torch.float16

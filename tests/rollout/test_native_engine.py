"""NativeRolloutEngine on tiny Qwen2/Llama models: exactness against HF, masks, stops, sampling."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hybridrl.protocol import DataProto
from hybridrl.rollout import NativeRolloutEngine, RolloutEngine, SamplingParams

pytestmark = pytest.mark.component

R = 10
VOCAB = 128
PAD, EOS = 0, 1


def build_tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer GQA model; initializer_range 0.2 spreads the logits so greedy has no near-ties."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    config = Qwen2Config(**common, tie_word_embeddings=True) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_model(request):
    return build_tiny(request.param)


def make_prompts(num: int = 4, length: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts (N,P) with varied real lengths; token ids avoid PAD and EOS."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (num, length), generator=gen)
    real = torch.tensor([length - (i * 3) % length for i in range(num)]).clamp(min=1)
    mask = (torch.arange(length)[None, :] >= (length - real)[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(do_sample=False, max_new_tokens=R, pad_token_id=PAD, **kw)


def sampled(**kw) -> SamplingParams:
    base = dict(temperature=0.8, max_new_tokens=R, pad_token_id=PAD, seed=7)
    return SamplingParams(**{**base, **kw})


def run(engine, params, prompts=None):
    return engine.generate_tensors(*(prompts or make_prompts()).values(), params)


def hf_log_probs(model, out, temperature: float) -> torch.Tensor:
    """Log-probs of out's responses under a full HF forward, logits / temperature (B,R)."""
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    plen = out["prompts"].shape[1]
    scaled = logits[:, plen - 1 : -1].float() / temperature
    return torch.log_softmax(scaled, -1).gather(-1, out["responses"][..., None]).squeeze(-1)


@pytest.mark.parametrize("compact", [True, False])
def test_greedy_equals_hf_generate(tiny_model, compact):
    prompts = make_prompts()
    out = run(NativeRolloutEngine(tiny_model, compact=compact), greedy())
    with torch.no_grad():
        ref = tiny_model.generate(
            input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"], max_new_tokens=R,
            do_sample=False, eos_token_id=None, pad_token_id=PAD,
        )
    assert torch.equal(out["responses"], ref[:, prompts["input_ids"].shape[1] :])


def test_output_shapes_and_masks(tiny_model):
    prompts = make_prompts()
    out = run(NativeRolloutEngine(tiny_model), sampled(n=2, eos_token_id=EOS))
    b, p = 8, prompts["input_ids"].shape[1]
    assert out["prompts"].shape == (b, p) and out["responses"].shape == (b, R)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert out[key].shape == (b, p + R), key
    assert out["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["attention_mask"][:, :p], prompts["attention_mask"].repeat_interleave(2, 0))
    assert torch.equal(out["attention_mask"][:, p:], out["response_mask"])
    expected_pos = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(out["position_ids"], expected_pos)
    assert torch.equal(out["position_ids"][:, :p], prompts["position_ids"].repeat_interleave(2, 0))


@pytest.mark.parametrize("compact", [True, False])
def test_stop_token_ends_response_and_pads(tiny_model, compact):
    engine = NativeRolloutEngine(tiny_model, compact=compact)
    free = run(engine, greedy())["responses"]
    stop = int(free[0, 3])  # a token row 0 is known to produce: it must end at its first occurrence
    out = run(engine, greedy(stop_token_ids=(stop,)))
    for row in range(free.shape[0]):
        hits = (free[row] == stop).nonzero().flatten()
        length = int(hits[0]) + 1 if hits.numel() else R
        assert int(out["response_mask"][row].sum()) == length
        assert torch.equal(out["response_mask"][row, :length], torch.ones(length, dtype=torch.long))
        assert torch.equal(out["responses"][row, :length], free[row, :length])
        assert (out["responses"][row, length:] == PAD).all()
        assert (out["rollout_log_probs"][row, length:] == 0).all()
        assert (out["rollout_log_probs"][row, :length] < 0).all()
    assert int(out["response_mask"][0].sum()) <= 4


def test_eos_id_list_stops_like_stop_tokens(tiny_model):
    engine = NativeRolloutEngine(tiny_model)
    free = run(engine, greedy())["responses"]
    stops = (int(free[1, 2]), int(free[2, 5]))
    by_eos = run(engine, greedy(eos_token_id=stops))
    by_stop = run(engine, greedy(stop_token_ids=stops))
    assert torch.equal(by_eos["responses"], by_stop["responses"])
    assert int(by_eos["response_mask"][1].sum()) <= 3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_hf_forward(tiny_model, temperature):
    out = run(NativeRolloutEngine(tiny_model), sampled(n=2, temperature=temperature, eos_token_id=EOS))
    ref = hf_log_probs(tiny_model, out, temperature) * out["response_mask"]
    assert (out["rollout_log_probs"] - ref).abs().max() < 1e-4


def test_log_probs_are_before_top_k_filtering(tiny_model):
    out = run(NativeRolloutEngine(tiny_model), sampled(top_k=3, top_p=0.9))
    assert (out["rollout_log_probs"] - hf_log_probs(tiny_model, out, 0.8)).abs().max() < 1e-4


def test_top_k_samples_stay_in_top_k(tiny_model):
    out = run(NativeRolloutEngine(tiny_model), sampled(n=4, top_k=2, temperature=2.0))
    with torch.no_grad():
        logits = tiny_model(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).logits
    plen = out["prompts"].shape[1]
    top2 = logits[:, plen - 1 : -1].topk(2, dim=-1).indices
    assert (top2 == out["responses"][..., None]).any(-1).all()


def test_seed_reproducible_and_seeds_differ(tiny_model):
    engine = NativeRolloutEngine(tiny_model)
    a, b = run(engine, sampled(n=3)), run(engine, sampled(n=3))
    c = run(engine, sampled(n=3, seed=8))
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
    assert not torch.equal(a["responses"], c["responses"])


def test_rows_do_not_depend_on_other_rows_or_chunking(tiny_model):
    prompts = make_prompts()
    params = sampled(n=2, eos_token_id=EOS)
    base = run(NativeRolloutEngine(tiny_model), params, prompts)
    chunked = run(NativeRolloutEngine(tiny_model, max_num_seqs=2), params, prompts)
    assert torch.equal(base["responses"], chunked["responses"])
    changed = {k: v.clone() for k, v in prompts.items()}
    changed["input_ids"][0, -3:] = torch.tensor([5, 6, 7])  # prompt 0 differs, rows 2.. must not
    other = run(NativeRolloutEngine(tiny_model), params, changed)
    assert torch.equal(other["responses"][2:], base["responses"][2:])
    assert not torch.equal(other["responses"][:2], base["responses"][:2])


def test_compact_and_generic_paths_sample_the_same(tiny_model):
    params = sampled(n=2, top_p=0.9, eos_token_id=EOS)
    fast = run(NativeRolloutEngine(tiny_model, compact=True), params)
    slow = run(NativeRolloutEngine(tiny_model, compact=False), params)
    assert torch.equal(fast["responses"], slow["responses"])
    assert (fast["rollout_log_probs"] - slow["rollout_log_probs"]).abs().max() < 1e-4


def test_packed_decode_matches_plain_as_rows_finish(tiny_model, monkeypatch):
    # many stop tokens: rows finish early, so steps run zero-padded up to the packed row count and
    # the weights are packed again once the live rows fall to half of it (MKL's packing; without the
    # fused kernels, whose own packing is tested in test_cpu_kernels.py)
    from hybridrl.utils import cpu_matmul

    monkeypatch.setattr(cpu_matmul, "_choice", "mkl")  # where oneDNN is chosen nothing is packed (next test)
    params = sampled(n=4, temperature=1.5, stop_token_ids=tuple(range(2, 40)))
    plain = run(NativeRolloutEngine(tiny_model, pack_weights=False), params)
    engine = NativeRolloutEngine(tiny_model, pack_weights=True, fused_kernels=False)
    calls = []
    decoder_rows = engine.decoder._packed_rows_for
    monkeypatch.setattr(engine.decoder, "_packed_rows_for", lambda rows: calls.append((rows, decoder_rows(rows))) or calls[-1][1])
    packed = run(engine, params)
    assert torch.equal(packed["responses"], plain["responses"])
    assert (packed["rollout_log_probs"] - plain["rollout_log_probs"]).abs().max() < 1e-5
    assert any(rows < packed_rows for rows, packed_rows in calls)  # padded steps
    assert len({packed_rows for _, packed_rows in calls}) >= 2  # packed again for fewer rows
    assert plain["response_mask"].sum(1).float().mean() < R / 2  # rows did finish early
    engine.free_cache()
    assert engine.decoder.packed_rows == 0 and all(layer.packed is None for layer in engine.decoder.layers)


def test_onednn_decode_matches_plain_and_packs_nothing(tiny_model, monkeypatch):
    # where oneDNN is the CPU matmul backend (hybridrl.utils.cpu_matmul) its plain products replace
    # MKL's packed ones: prefill, decode steps and the LM head through it, no weight packed
    from hybridrl.utils import cpu_matmul

    if not cpu_matmul.onednn_available():
        pytest.skip("torch without oneDNN")
    params = sampled(n=4, temperature=1.5, stop_token_ids=tuple(range(2, 40)))
    monkeypatch.setattr(cpu_matmul, "_choice", "mkl")
    plain = run(NativeRolloutEngine(tiny_model, pack_weights=False), params)
    monkeypatch.setattr(cpu_matmul, "_choice", "onednn")
    calls = []
    product = cpu_matmul._onednn
    monkeypatch.setattr(cpu_matmul, "_onednn", lambda *args: calls.append(args[0].shape[0]) or product(*args))
    engine = NativeRolloutEngine(tiny_model, pack_weights=True, fused_kernels=False)
    ours = run(engine, params)
    assert torch.equal(ours["responses"], plain["responses"])
    assert (ours["rollout_log_probs"] - plain["rollout_log_probs"]).abs().max() < 1e-5
    assert calls and engine.decoder.packing is None and engine.decoder.packed_rows == 0
    assert len(set(calls)) >= 3  # prefill rows, then decode steps of shrinking row counts


def test_compact_norm_and_rotary_equal_hf_bit_for_bit(tiny_model):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hybridrl.rollout.decoder import CompactDecoder, _rotate, _signed_sin

    gen = torch.Generator().manual_seed(0)
    layer = tiny_model.model.layers[0]
    weighted = copy.deepcopy(layer.input_layernorm)  # a copy: the module-scoped model stays as built
    with torch.inference_mode():
        weighted.weight.copy_(torch.rand(64, generator=gen) + 0.5)  # not all ones
        for norm in (weighted, layer.post_attention_layernorm, tiny_model.model.norm):
            for shape in ((16, 1, 64), (3, 37, 64)):
                x = torch.randn(shape, generator=gen) * 7
                assert torch.equal(CompactDecoder._norm(norm, x), norm(x))
        q, k = torch.randn(5, 4, 7, 16, generator=gen), torch.randn(5, 2, 7, 16, generator=gen)
        cos, sin = torch.randn(5, 7, 16, generator=gen), torch.randn(5, 7, 16, generator=gen)
        expected, _ = apply_rotary_pos_emb(q, k, cos, sin)
        ours = _rotate(q.transpose(1, 2), cos.unsqueeze(2), _signed_sin(sin).unsqueeze(2)).transpose(1, 2)
        assert torch.equal(ours, expected)


def test_packed_layout_reuses_the_model_weights(tiny_model):
    # packing keeps nn.Linear's (out, in) layout: o/down are the model's own tensors (no copy per
    # weight update), q/k/v and gate/up one concatenated copy; the plain path keeps (in, out) copies
    attn, mlp = tiny_model.model.layers[0].self_attn, tiny_model.model.layers[0].mlp
    packed = NativeRolloutEngine(tiny_model, pack_weights=True).decoder.layers[0]
    assert packed.weight("o").data_ptr() == attn.o_proj.weight.data_ptr()
    assert packed.weight("down").data_ptr() == mlp.down_proj.weight.data_ptr()
    qkv = packed.weight("qkv")
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert packed.weight("qkv") is qkv  # made once per refresh
    assert torch.equal(packed.weight("gate_up"), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    plain = NativeRolloutEngine(tiny_model, pack_weights=False).decoder.layers[0]
    assert plain.weight("o").data_ptr() != attn.o_proj.weight.data_ptr() and plain.weight("o").is_contiguous()
    assert torch.equal(plain.weight("gate_up"), packed.weight("gate_up").t())


def test_pack_weights_needs_fp32_cpu_and_the_compact_decoder(tiny_model):
    with pytest.raises(ValueError, match="fp32"):
        NativeRolloutEngine(copy.deepcopy(tiny_model).to(torch.bfloat16), pack_weights=True)
    with pytest.raises(ValueError, match="compact decoder"):
        NativeRolloutEngine(tiny_model, compact=False, pack_weights=True)


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}])
def test_degenerate_filters_equal_greedy(tiny_model, filters):
    engine = NativeRolloutEngine(tiny_model)
    out = run(engine, sampled(n=2, temperature=1.5, **filters))
    ref = run(engine, greedy())
    assert torch.equal(out["responses"], ref["responses"].repeat_interleave(2, 0))


def test_n_samples_are_interleaved(tiny_model):
    prompts = make_prompts()
    engine = NativeRolloutEngine(tiny_model)
    out = run(engine, sampled(n=3, temperature=1.5), prompts)
    assert torch.equal(out["prompts"].view(4, 3, -1), prompts["input_ids"][:, None].expand(4, 3, -1))
    assert not torch.equal(out["responses"][0], out["responses"][1])  # G samples differ
    greedy_n = run(engine, greedy(n=2))["responses"]
    assert torch.equal(greedy_n, run(engine, greedy())["responses"].repeat_interleave(2, 0))


def test_generate_dataproto_repeats_non_tensors(tiny_model):
    uids = np.array(["a", "b", "c", "d"], dtype=object)
    data = DataProto.from_dict(tensors=make_prompts(), non_tensors={"uid": uids}, meta_info={"step": 3})
    engine = NativeRolloutEngine(tiny_model)
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(data, sampled(n=2))
    assert len(out) == 8 and list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert out.meta_info["step"] == 3
    assert {"prompts", "responses", "response_mask", "rollout_log_probs"} <= set(out.batch)


@pytest.mark.parametrize("compact", [True, False])
def test_update_weights_switches_model(compact):
    first, second = build_tiny("qwen2", seed=0), build_tiny("qwen2", seed=1)
    engine = NativeRolloutEngine(first, compact=compact)
    before = run(engine, greedy())["responses"]
    engine.update_weights(second.state_dict().items())
    after = run(engine, greedy())["responses"]
    expected = run(NativeRolloutEngine(build_tiny("qwen2", seed=1), compact=compact), greedy())["responses"]
    assert not torch.equal(before, after)
    assert torch.equal(after, expected)


def test_shared_weights_are_read_in_place_and_follow_the_trainer():
    trainer = build_tiny("qwen2", seed=1)  # stands for the colocated actor's model
    engine = NativeRolloutEngine(build_tiny("qwen2", seed=0), share_weights=True)
    engine.update_weights((name, t.detach()) for name, t in trainer.named_parameters())
    shared = dict(engine.model.named_parameters())
    assert all(shared[name].data_ptr() == t.data_ptr() for name, t in trainer.named_parameters())
    expected = run(NativeRolloutEngine(copy.deepcopy(trainer)), greedy())["responses"]
    assert torch.equal(run(engine, greedy())["responses"], expected)
    # the trainer steps in place; the next sync copies nothing and re-derives the fused weights
    with torch.no_grad():
        for param in trainer.parameters():
            param.mul_(1.5)
    engine.update_weights((name, t.detach()) for name, t in trainer.named_parameters())
    expected = run(NativeRolloutEngine(copy.deepcopy(trainer)), greedy())["responses"]
    assert torch.equal(run(engine, greedy())["responses"], expected)


def test_update_weights_copies_by_default():
    source = build_tiny("qwen2", seed=1)
    engine = NativeRolloutEngine(build_tiny("qwen2", seed=0))
    engine.update_weights((name, t.detach()) for name, t in source.named_parameters())
    ptrs = {name: t.data_ptr() for name, t in source.named_parameters()}
    assert all(t.data_ptr() != ptrs[name] for name, t in engine.model.named_parameters())


def test_update_weights_rejects_unknown_and_misshaped(tiny_model):
    engine = NativeRolloutEngine(tiny_model)
    with pytest.raises(KeyError, match="model.norm.weight"):
        engine.update_weights([("model.norm.weigth", torch.ones(64))])
    with pytest.raises(ValueError, match=r"\(3,\)"):
        engine.update_weights([("model.norm.weight", torch.ones(3))])


def test_free_cache_then_generate_again(tiny_model):
    engine = NativeRolloutEngine(tiny_model)
    first = run(engine, sampled(eos_token_id=EOS))
    engine.free_cache()
    engine.sleep()
    engine.wake()
    assert torch.equal(run(engine, sampled(eos_token_id=EOS))["responses"], first["responses"])


def test_right_padded_prompts_are_rejected(tiny_model):
    prompts = make_prompts()
    prompts["attention_mask"][2] = prompts["attention_mask"][2].flip(0)
    with pytest.raises(ValueError, match=r"left-padded.*\[2\]"):
        run(NativeRolloutEngine(tiny_model), greedy(), prompts)


@pytest.mark.parametrize(("key", "value"), [("n", 0), ("top_p", 0.0), ("temperature", -1.0), ("top_k", -2)])
def test_sampling_params_validation_names_the_key(key, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{key}"):
        SamplingParams(**{key: value})


@pytest.mark.gpu
def test_cuda_greedy_matches_cpu():
    model = build_tiny("qwen2")
    cpu = run(NativeRolloutEngine(model), greedy(eos_token_id=EOS))
    prompts = {k: v.cuda() for k, v in make_prompts().items()}
    gpu = run(NativeRolloutEngine(build_tiny("qwen2").cuda()), sampled(top_k=1, eos_token_id=EOS), prompts)
    assert torch.equal(gpu["responses"].cpu(), cpu["responses"])

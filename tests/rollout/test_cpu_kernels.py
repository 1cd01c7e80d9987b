"""The fused CPU decode kernels: each against torch's ops, and the decoder with them against without."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from hybridrl.rollout import NativeRolloutEngine, SamplingParams, cpu_kernels, sampling
from hybridrl.rollout.decoder import CompactDecoder, _rotate, _signed_sin
from tests.rollout.test_native_engine import EOS, build_tiny, greedy, make_prompts, run, sampled

pytestmark = pytest.mark.component


@pytest.fixture(scope="module")
def kernels():
    # built here rather than through `load`, so a machine that cannot build them fails this test
    return cpu_kernels.build_and_load()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_model(request):
    return build_tiny(request.param)


def test_add_rms_norm_matches_torch(kernels):
    gen = torch.Generator().manual_seed(0)
    hidden, x = torch.randn(6, 96, generator=gen) * 3, torch.randn(6, 96, generator=gen)
    weight = torch.rand(96, generator=gen) + 0.5
    expected_hidden = hidden[:4] + x[:4]
    expected = torch.rms_norm(expected_hidden, (96,), weight, 1e-6)
    out = torch.full((6, 96), 7.0)
    before = hidden.clone()
    kernels.add_rms_norm(hidden, x, weight, 1e-6, out, rows=4)
    assert torch.equal(hidden[:4], expected_hidden)  # the residual add is one rounding, as torch's
    torch.testing.assert_close(out[:4], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(hidden[4:], before[4:]) and (out[4:] == 7.0).all()  # rows past `rows` untouched
    kernels.add_rms_norm(hidden, None, weight, 1e-6, out, rows=6)  # no residual: norm only
    torch.testing.assert_close(out, torch.rms_norm(hidden, (96,), weight, 1e-6), rtol=1e-6, atol=1e-6)


def test_silu_mul_matches_torch(kernels):
    gate_up = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(1)) * 6
    out = torch.zeros(5, 40)
    kernels.silu_mul(gate_up, out, rows=3)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out[:3], F.silu(gate[:3]) * up[:3], rtol=2e-6, atol=1e-7)
    assert (out[3:] == 0).all()


def test_silu_mul_gives_the_update_s_swiglu_floats(kernels):
    """The rollout's activation and the trainer's (hybridrl.engine.cpu_attention.swiglu) share one
    SIMD function, so a decode step and the update compute the same activations."""
    from hybridrl.engine import cpu_attention

    if not kernels.dense_supported or not cpu_attention.available():
        pytest.skip("no AVX2 / AVX-512 kernels on this machine")
    gate_up = torch.randn(7, 2 * 45, generator=torch.Generator().manual_seed(2)) * 30  # past exp's range too
    out = torch.zeros(7, 45)
    kernels.silu_mul(gate_up, out, rows=7)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(out, cpu_attention.swiglu(gate.contiguous(), up.contiguous()))


def test_norm_and_activation_split_over_threads_give_one_threads_bits(kernels):
    # 32 rows of SmolLM2's widths: above the size from which the rows are split over the threads
    gen = torch.Generator().manual_seed(4)
    hidden, x, weight = torch.randn(32, 576, generator=gen), torch.randn(32, 576, generator=gen), torch.rand(576) + 0.5
    gate_up = torch.randn(32, 2 * 1536, generator=gen) * 4
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            h, out, act = hidden.clone(), torch.empty(32, 576), torch.empty(32, 1536)
            kernels.add_rms_norm(h, x, weight, 1e-5, out, rows=30)
            kernels.silu_mul(gate_up, act, rows=30)
            results.append((h[:30], out[:30], act[:30]))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)
    gate, up = gate_up[:30].chunk(2, dim=-1)
    torch.testing.assert_close(results[1][2], F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(results[1][1], torch.rms_norm(hidden[:30] + x[:30], (576,), weight, 1e-5),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 2, 16), (9, 3, 64), (4, 4, 64), (8, 1, 64), (10, 1, 64),
                                                      (2, 2, 32), (4, 2, 32), (4, 2, 128), (8, 1, 128), (16, 2, 32)])
def test_decode_attention_matches_torch(kernels, heads, kv_heads, d):
    gen = torch.Generator().manual_seed(2)
    rows, max_rows, slots, slot = 3, 5, 12, 8
    cache = torch.randn(2, max_rows, kv_heads, slots, d, generator=gen)
    keys, values = cache[0], cache[1]
    valid = torch.ones(max_rows, slots, dtype=torch.bool)
    valid[0, :3] = False  # left padding of row 0
    valid[2, 5] = False
    qkv = torch.randn(rows + 1, (heads + 2 * kv_heads) * d, generator=gen)  # one extra (padding) row
    cos, sin = torch.randn(rows, d, generator=gen), torch.randn(rows, d, generator=gen)
    signed_sin = _signed_sin(sin)
    out = torch.zeros(rows + 1, heads * d)
    before = cache.clone()
    scale = d**-0.5  # as the models scale it
    kernels.decode_attention(qkv, cos, signed_sin, keys, values, valid, slot, out, rows, heads, kv_heads, scale)

    q, k, v = qkv[:rows].split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    rot = lambda x, h: _rotate(x.view(rows, 1, h, d), cos[:, None, None], signed_sin[:, None, None])  # noqa: E731
    q, k = rot(q, heads)[:, 0], rot(k, kv_heads)[:, 0]
    assert torch.equal(keys[:rows, :, slot], k)  # rotary as torch rounds it, written to the slot
    assert torch.equal(values[:rows, :, slot], v.view(rows, kv_heads, d))
    changed = (cache != before).any(-1)
    assert not changed[:, :, :, :slot].any() and not changed[:, rows:].any()  # nothing else written
    mask = valid[:rows, None, None, : slot + 1]
    expected = F.scaled_dot_product_attention(q[:, :, None], keys[:rows, :, : slot + 1], values[:rows, :, : slot + 1],
                                              attn_mask=mask, scale=scale, enable_gqa=True)
    torch.testing.assert_close(out[:rows], expected.reshape(rows, heads * d), rtol=1e-5, atol=1e-6)
    assert (out[rows:] == 0).all()


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 2, 16), (4, 2, 32), (10, 1, 64)])
def test_decode_attention_reads_shared_prompts_from_their_store(kernels, heads, kv_heads, d):
    # rows 0-1 sample prompt 1, rows 2-3 prompt 0 (4 slots each); slots from 4 on are each row's own
    gen = torch.Generator().manual_seed(3)
    rows, plen, slots, slot = 4, 4, 12, 9
    full = torch.randn(2, rows, kv_heads, slots, d, generator=gen)  # per-row copies: the reference layout
    source = torch.tensor([1, 1, 0, 0])
    store = torch.randn(2, 2, kv_heads, plen, d, generator=gen)
    full[:, :, :, :plen] = store[:, source]
    own = full[:, :, :, plen:].clone()  # slot s at index s - plen
    valid = torch.ones(rows, slots, dtype=torch.bool)
    valid[2:, 0] = False  # prompt 0 is left-padded
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    cos, sin = torch.randn(rows, d, generator=gen), _signed_sin(torch.randn(rows, d, generator=gen))
    expected, out = torch.zeros(rows, heads * d), torch.zeros(rows, heads * d)
    kernels.decode_attention(qkv, cos, sin, full[0], full[1], valid, slot, expected, rows, heads, kv_heads, 0.125)
    kernels.decode_attention(qkv, cos, sin, own[0], own[1], valid, slot, out, rows, heads, kv_heads, 0.125,
                             (store[0], store[1]), source, plen)
    assert torch.equal(out, expected)
    assert torch.equal(own, full[:, :, :, plen:])  # the new token written at index slot - plen


@pytest.fixture(scope="module")
def half_kernels(kernels):
    if not kernels.kv_half_supported:
        pytest.skip("a float16 KV cache needs F16C conversions (an AVX-512 or AVX2 build)")
    return kernels


@pytest.mark.parametrize("plen", [0, 4], ids=["own-slots", "shared-prompts"])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 2, 16), (4, 2, 32)])
def test_a_float16_cache_is_the_float32_kernel_on_its_rounded_values(half_kernels, heads, kv_heads, d, plen):
    # keys, values and the new token's that float16 holds exactly, rotary cos 1 and sin 0 (the new key
    # is then its own input): the float16 cache's attention is the float32 kernel's on the same values,
    # to float rounding (each dtype reads its cache through an instance of its own, which -ffast-math
    # may sum in another order)
    gen = torch.Generator().manual_seed(5)
    rows, slots, slot = 4, 12, 9
    cache = torch.randn(2, rows, kv_heads, slots - plen, d, generator=gen).half()
    store = torch.randn(2, 2, kv_heads, max(plen, 1), d, generator=gen).half()[:, :, :, :plen]
    source = torch.tensor([1, 1, 0, 0]) if plen else None
    valid = torch.ones(rows, slots, dtype=torch.bool)
    valid[2:, 0] = False
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen).half().float()
    cos, sin = torch.ones(rows, d), torch.zeros(rows, d)
    outs, caches = {}, {}
    for dtype in (torch.float16, torch.float32):
        kv, prompts = cache.to(dtype), (store[0].to(dtype), store[1].to(dtype)) if plen else None
        outs[dtype] = torch.zeros(rows, heads * d)
        half_kernels.decode_attention(qkv, cos, sin, kv[0], kv[1], valid, slot, outs[dtype], rows, heads, kv_heads,
                                      0.125, prompts, source, plen)
        caches[dtype] = kv
    torch.testing.assert_close(outs[torch.float16], outs[torch.float32], rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[torch.float16].float(), caches[torch.float32])  # the new slot written alike


def test_a_float16_cache_stores_the_new_token_rounded(half_kernels):
    # with a real rotation the new key is the float32 kernel's rotated key, rounded to nearest float16
    gen = torch.Generator().manual_seed(6)
    rows, heads, kv_heads, d, slots, slot = 3, 4, 2, 32, 8, 5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    cos, sin = torch.randn(rows, d, generator=gen), _signed_sin(torch.randn(rows, d, generator=gen))
    valid = torch.ones(rows, slots, dtype=torch.bool)
    exact, half = torch.zeros(2, rows, kv_heads, slots, d), torch.zeros(2, rows, kv_heads, slots, d).half()
    out = torch.zeros(rows, heads * d)
    for cache in (exact, half):
        half_kernels.decode_attention(qkv, cos, sin, cache[0], cache[1], valid, slot, out, rows, heads, kv_heads, 0.2)
    assert torch.equal(half[:, :, :, slot], exact[:, :, :, slot].half())
    assert not torch.equal(half[:, :, :, slot].float(), exact[:, :, :, slot])  # it was rounded
    with pytest.raises(ValueError, match="must all be float32 or all float16"):
        half_kernels.decode_attention(qkv, cos, sin, half[0], exact[1], valid, slot, out, rows, heads, kv_heads, 0.2)


@pytest.mark.parametrize("pack", [None, False], ids=["one-call-per-step", "per-layer-calls"])
def test_a_float16_kv_cache_rounds_only_the_cache(tiny_model, half_kernels, pack):
    # greedy, 4 left-padded prompts x 3 samples sharing their prompt's slots, rows finishing early:
    # the same tokens as the float32 cache, log-probs off by the cache's rounding and no more
    params = greedy(n=3, stop_token_ids=tuple(range(2, 40)))
    exact = run(NativeRolloutEngine(tiny_model, fused_kernels=True, pack_weights=pack), params)
    engine = NativeRolloutEngine(tiny_model, fused_kernels=True, pack_weights=pack, kv_cache_dtype=torch.float16)
    out = run(engine, params)
    cache = engine.decoder.cache
    assert cache.buffer.dtype == torch.float16 and cache.prompt_store.dtype == torch.float16
    assert (engine.decoder.step_tables is not None) == (pack is None)
    assert torch.equal(out["responses"], exact["responses"])
    diff = (out["rollout_log_probs"] - exact["rollout_log_probs"]).abs().max()
    assert 0 < diff < 1e-2  # 4e-3 (qwen2) here, against log-probs of order 1


def test_a_float16_kv_cache_needs_the_fused_kernels(tiny_model, monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype=float16 needs the native engine's fused CPU kernels"):
        NativeRolloutEngine(tiny_model, fused_kernels=False, kv_cache_dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_cache_dtype=torch.float16 needs the compact decoder"):
        NativeRolloutEngine(tiny_model, compact=False, kv_cache_dtype=torch.float16)
    with pytest.raises(ValueError, match="or float16 for float32 weights"):
        NativeRolloutEngine(tiny_model, kv_cache_dtype=torch.bfloat16)
    if cpu_kernels.load() is not None and cpu_kernels.load().kv_half_supported:
        monkeypatch.setattr(cpu_kernels, "HALF_ROW", 8)  # the C side's row bound, here below the model's head size
        with pytest.raises(ValueError, match="takes head sizes up to 8"):
            NativeRolloutEngine(tiny_model, kv_cache_dtype=torch.float16)


@pytest.fixture(scope="module")
def dense_kernels(kernels):
    if not kernels.dense_supported:
        pytest.skip("the matmul kernel needs an AVX-512 or AVX2 + FMA build (this CPU or compiler has neither)")
    return kernels


def blocked_float32_error(x: torch.Tensor, weight: torch.Tensor, want: torch.Tensor, chunk: int) -> torch.Tensor:
    """The error against float64 (relative to 1 + |want|) of a plain float32 sum in the kernel's
    order: each chunk of k steps summed one product at a time, the chunks' sums added in turn."""
    total = torch.zeros(x.shape[0], weight.shape[0])
    for start in range(0, x.shape[1], chunk):
        part = torch.zeros_like(total)
        for kk in range(start, min(start + chunk, x.shape[1])):
            part += x[:, kk:kk + 1] * weight[:, kk]
        total += part
    return ((total - want).abs() / (1 + want.abs())).max()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(5, 7), (16, 64), (24, 7), (48, 64), (88, 37), (100, 130), (128, 130), (960, 576),
                                    (577, 1536)])
def test_dense_matches_a_float64_matmul(dense_kernels, n, k, threads):
    # rows: one, a partial register tile, a full one, several (13: chunks of 64 k-steps; 29: of 128),
    # and past one 64-row block; columns: a partial panel, exact panels, and last panels of 1-5 of
    # their six 8-column vectors (5, 16, 24, 32, 40, 4 and 1 columns); k: under, at and over one
    # 64-step chunk. The bar is 3x the larger of two float32 errors: torch's matmul's, and a plain
    # sum's in the kernel's blocks. Torch's alone depends on the BLAS and CPU: MKL on an Intel Xeon
    # summed 3 rows x 130 products to 9.1e-7, the kernel to 4.3e-6 and a plain sum in its blocks to
    # 5.8e-6 (seed as below).
    gen = torch.Generator().manual_seed(n * k)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = dense_kernels.pack_weight(weight)
        assert packed.numel() == -(-n // 48) * 48 * k
        for m in (1, 3, 8, 13, 29, 64, 70):
            x = torch.randn(m, k, generator=gen)
            exact = x.double() @ weight.double().T + bias.double()
            blocked_error = blocked_float32_error(x, weight, exact - bias.double(), 128 if m >= 25 else 64)
            for b in (bias, None):
                out = dense_kernels.dense(x, packed, n, b)
                want = exact if b is not None else exact - bias.double()
                torch_error = ((F.linear(x, weight, b) - want).abs() / (1 + want.abs())).max()
                error = ((out - want).abs() / (1 + want.abs())).max()
                bar = 3 * max(torch_error, blocked_error) + 1e-6
                assert out.shape == (m, n) and error <= bar, (m, b is None, error, torch_error, blocked_error)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_dense_gives_the_same_bits_for_every_stream_count(dense_kernels, threads, monkeypatch):
    # the runs of panels walked side by side change which panel is read when, never what a column
    # sums: 1, 2 and 4 streams must give identical outputs. Panel counts from 1 to 21 (5 columns to
    # 1000), so runs split evenly and unevenly, and some streams' runs end a panel short; rows in one
    # tile to past a 64-row block; k under, at and over one chunk
    gen = torch.Generator().manual_seed(threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in [(5, 7), (48, 64), (100, 130), (250, 64), (530, 200), (1000, 37)]:
            weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            packed = dense_kernels.pack_weight(weight)
            for m in (1, 8, 13, 29, 70):
                x = torch.randn(m, k, generator=gen)
                outs = {}
                for streams in (1, 2, 4):
                    monkeypatch.setattr(dense_kernels, "dense_streams", streams)
                    outs[streams] = dense_kernels.dense(x, packed, n, bias)
                assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[4]), (n, k, m)
                assert torch.allclose(outs[1], F.linear(x, weight, bias), rtol=1e-4, atol=1e-4), (n, k, m)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(("vendor", "streams"), [("GenuineIntel", 2), ("AuthenticAMD", 1), (None, 1)])
def test_dense_reads_two_streams_on_intel_cpus(vendor, streams, monkeypatch):
    monkeypatch.delenv(cpu_kernels.STREAMS_ENV, raising=False)
    cpuinfo = "processor\t: 0\nflags\t\t: avx2\n" + (f"vendor_id\t: {vendor}\n" if vendor else "")
    assert cpu_kernels.dense_streams(cpuinfo) == streams


def test_the_stream_count_can_be_set_and_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_kernels.STREAMS_ENV, "4")
    assert cpu_kernels.dense_streams("vendor_id\t: AuthenticAMD\n") == 4
    monkeypatch.setenv(cpu_kernels.STREAMS_ENV, "3")
    with pytest.raises(ValueError, match="HYBRIDRL_DECODE_STREAMS='3': expected 1, 2 or 4"):
        cpu_kernels.dense_streams("vendor_id\t: GenuineIntel\n")


def test_dense_packing_is_panels_of_48_columns(dense_kernels):
    weight = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    packed = dense_kernels.pack_weight(weight).view(2, 3, 48)  # 2 panels x k x 48 columns
    assert torch.equal(packed[0], weight[:48].T)
    assert torch.equal(packed[1, :, :2], weight[48:].T) and (packed[1, :, 2:] == 0).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [(128, 64, 64), (96, 32, 32, 1), (20, 30, 7), (16, 5, 48, 33), (200,)],
                         ids=["qkv-16-aligned", "tail-block", "unaligned", "mixed", "one"])
@pytest.mark.parametrize("k", [3, 16, 37, 576])
def test_packing_several_weights_equals_packing_their_concatenation(dense_kernels, rows, k, threads):
    # offsets that are multiples of 16 take the register transposes (with a partial last block of 16
    # rows, which must not write into the next weight's columns); the others go element by element
    gen = torch.Generator().manual_seed(sum(rows) * k)
    weights = [torch.randn(n, k, generator=gen) for n in rows]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = dense_kernels.pack_weight(*weights)
    finally:
        torch.set_num_threads(previous)
    full = torch.cat(weights)
    panels = -(-full.shape[0] // 48)
    expected = torch.zeros(panels * 48, k)
    expected[: full.shape[0]] = full
    assert torch.equal(together.view(panels, k, 48), expected.view(panels, 48, k).transpose(1, 2))
    assert torch.equal(together, dense_kernels.pack_weight(full))


def test_packing_refuses_weights_of_different_widths(dense_kernels):
    with pytest.raises(ValueError, match=r"\(n, 4\) weights expected, got \[\(2, 4\), \(3, 5\)\]"):
        dense_kernels.pack_weight(torch.zeros(2, 4), torch.zeros(3, 5))


@pytest.mark.parametrize("n", [1, 3], ids=["own-prompts", "shared-prompts"])
def test_one_call_per_decode_step_equals_the_per_layer_calls(dense_kernels, tiny_model, monkeypatch, n):
    # the layers of a step through hr_decode_layers give the per-layer kernel calls' bits, with biases
    # (qwen2) and without (llama), rows finishing early (stop tokens), prompts shared by samples or not
    from hybridrl.rollout import decoder as decoder_module

    params = sampled(n=n, temperature=2.0, stop_token_ids=tuple(range(2, 30)))
    prompts = make_prompts(num=5, length=7, seed=3)
    model = copy.deepcopy(tiny_model)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # norms and biases of their own per layer (a fresh model's are all 1 / 0)
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    engine = NativeRolloutEngine(model, fused_kernels=True)
    calls, steps = [], []
    decode_layers, decode = engine.decoder.kernels.decode_layers, engine.decoder.decode
    monkeypatch.setattr(engine.decoder.kernels, "decode_layers", lambda *a, **k: calls.append(a[2]) or decode_layers(*a, **k))
    monkeypatch.setattr(engine.decoder, "decode", lambda tokens, positions: steps.append(1) or decode(tokens, positions))
    ours = run(engine, params, prompts)
    assert len(calls) == len(steps) > 1 and len(set(calls)) >= 2  # every step, and the live rows shrank
    monkeypatch.setattr(decoder_module.CompactDecoder, "_step_tables", lambda self: None)
    engine.decoder._drop_packed()
    per_layer = run(engine, params, prompts)
    for key, value in ours.items():
        assert torch.equal(value, per_layer[key]), key


def test_a_small_prefill_runs_on_the_packed_weights(dense_kernels, tiny_model, monkeypatch):
    # prompts of a few hundred tokens ahead of decode steps on the kernels: the prefill's products run
    # on the packed weights too, and no joined q/k/v or gate/up matrix is made; a larger prefill takes
    # oneDNN's / torch's products on the joined matrices; the tokens are the same
    from hybridrl.rollout import decoder as decoder_module

    prompts = make_prompts(num=6, length=9, seed=4)
    engine = NativeRolloutEngine(tiny_model, fused_kernels=True)
    calls = []
    dense = engine.decoder.kernels.dense
    monkeypatch.setattr(engine.decoder.kernels, "dense", lambda x, *a: calls.append(x.shape[0]) or dense(x, *a))
    small = run(engine, greedy(n=2), prompts)
    assert 6 * 9 in calls  # the prefill's rows through the kernel
    assert all(not layer.joined for layer in engine.decoder.layers)
    monkeypatch.setattr(decoder_module, "PREFILL_DENSE_MAX_TOKENS", 6 * 9 - 1)
    calls.clear()
    large = run(engine, greedy(n=2), prompts)
    assert 6 * 9 not in calls and all(set(layer.joined) == {"qkv", "o", "gate_up", "down"}
                                      for layer in engine.decoder.layers)
    assert torch.equal(small["responses"], large["responses"])
    torch.testing.assert_close(small["rollout_log_probs"], large["rollout_log_probs"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 32])  # 16: the rotary embedding by torch's ops; 32: by the kernel
def test_the_prefill_on_the_kernels_matches_the_torch_ops(kernels, monkeypatch, head_dim):
    # the prefill's norms, activation, rotary embedding and attention through hybridrl's kernels give
    # the torch ops' logits and KV cache to float rounding, with left-padded prompts (pad queries,
    # masked keys), and the same greedy tokens
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hybridrl.engine import cpu_attention
    from hybridrl.rollout import decoder as decoder_module

    if not cpu_attention.available():
        pytest.skip("the training attention kernels are not built on this machine")
    config = Qwen2Config(vocab_size=128, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                         max_position_embeddings=256)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompts = make_prompts(num=5, length=11, seed=2)
    outputs, caches, calls = {}, {}, []
    attention = cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a[0].shape) or attention(*a))
    monkeypatch.setattr(decoder_module, "PREFILL_DENSE_MAX_TOKENS", 0)  # the products as for a long prefill
    for path in ("kernels", "torch"):
        if path == "torch":
            monkeypatch.setattr(CompactDecoder, "_prefill_fused", lambda *a: None)
        decoder = CompactDecoder(model, fused_kernels=True)
        with torch.no_grad():
            logits = decoder.prefill(*prompts.values(), 1, 4)
        outputs[path], caches[path] = logits, decoder.cache.buffer[:, :, :5, :, :11].clone()
        engine = NativeRolloutEngine(model, fused_kernels=True)
        outputs[path + " tokens"] = run(engine, greedy(), prompts)["responses"]
    assert len(calls) == 2 * 2  # kernels: one attention call per layer (the prefill, then the engine's)
    torch.testing.assert_close(outputs["kernels"], outputs["torch"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches["kernels"], caches["torch"], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outputs["kernels"], outputs["torch"])  # two paths, not one
    assert torch.equal(outputs["kernels tokens"], outputs["torch tokens"])


def test_decode_tables_refuse_layers_of_different_shapes():
    layer = {"qkv": torch.zeros(4), "o": torch.zeros(4), "gate_up": torch.zeros(4), "down": torch.zeros(4),
             "qkv_b": None, "o_b": None, "gate_up_b": None, "down_b": None, "qkv_width": 8, "inter": 4}
    norms = [(torch.ones(4), 1e-6)] * 5
    assert cpu_kernels.decode_tables([layer, dict(layer)], norms).weights.shape == (2, 8)
    with pytest.raises(ValueError, match="layers of one shape"):
        cpu_kernels.decode_tables([layer, dict(layer, inter=8)], norms)
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu_kernels.decode_tables([dict(layer, o=torch.zeros(4, 2).t())], norms[:3])


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
def test_decode_moves_to_the_dense_kernel_as_rows_finish(dense_kernels, monkeypatch, backend):
    # 20 prompts x 4 samples = 80 rows: MKL's packing first (or, where oneDNN is the CPU matmul backend,
    # oneDNN's plain products: nothing packed); as rows finish, the fused kernels' (<= 56 rows, no
    # zero-padded rows, not packed again as rows keep finishing); tokens equal the plain path's.
    # The kernel's row limit (64, 128 with oneDNN) is set to 56 here, below the 80 rows.
    from hybridrl.rollout import decoder as decoder_module
    from hybridrl.utils import cpu_matmul

    if backend == "onednn" and not cpu_matmul.onednn_available():
        pytest.skip("torch without oneDNN")
    monkeypatch.setattr(cpu_matmul, "_choice", backend)
    DENSE_KERNEL_MAX_ROWS = 56
    monkeypatch.setattr(decoder_module, "DENSE_KERNEL_MAX_ROWS", DENSE_KERNEL_MAX_ROWS)
    monkeypatch.setattr(decoder_module, "DENSE_KERNEL_MAX_ROWS_ONEDNN", DENSE_KERNEL_MAX_ROWS)
    tiny = build_tiny("qwen2")
    params = sampled(n=4, temperature=1.5, stop_token_ids=tuple(range(2, 12)))
    prompts = make_prompts(num=20, length=6, seed=5)
    plain = run(NativeRolloutEngine(tiny, pack_weights=False, fused_kernels=False), params, prompts)
    engine = NativeRolloutEngine(tiny, fused_kernels=True)
    decoder, seen = engine.decoder, []
    rows_for = decoder._packed_rows_for
    monkeypatch.setattr(decoder, "_packed_rows_for",
                        lambda rows: seen.append((rows, rows_for(rows), decoder.packing)) or seen[-1][1])
    ours = run(engine, params, prompts)
    assert torch.equal(ours["responses"], plain["responses"])
    assert (ours["rollout_log_probs"] - plain["rollout_log_probs"]).abs().max() < 1e-5
    first = "mkl" if backend == "mkl" else None
    assert seen[0][2] == first and seen[0][0] > DENSE_KERNEL_MAX_ROWS
    if backend == "onednn":
        assert seen[0][1] == 0  # plain products: no padded row count
    dense = [(rows, width) for rows, width, packing in seen if packing == "dense"]
    assert dense and all(rows == width <= DENSE_KERNEL_MAX_ROWS for rows, width in dense)
    assert len({rows for rows, _ in dense}) >= 2  # rows kept finishing on the one packing
    packings = [packing for *_, packing in seen]
    before = len(packings) - len(dense)
    assert before > 0 and packings == [first] * before + ["dense"] * len(dense)  # first, then dense to the end
    engine.free_cache()
    assert decoder.packing is None and all(layer.packed is None and layer.kernels is None for layer in decoder.layers)


def test_builds_without_the_matmul_kernel_decode_with_mkl(tiny_model, kernels, monkeypatch):
    # a build without AVX-512 reports dense_supported False: small steps keep MKL's packed GEMM
    from hybridrl.utils import cpu_matmul

    monkeypatch.setattr(cpu_matmul, "_choice", "mkl")  # (with oneDNN chosen nothing is packed)
    plain = run(NativeRolloutEngine(tiny_model, pack_weights=False, fused_kernels=False), sampled())
    engine = NativeRolloutEngine(tiny_model, fused_kernels=True)
    monkeypatch.setattr(engine.decoder.kernels, "dense_supported", False)
    packings = []
    rows_for = engine.decoder._packed_rows_for

    def recording(rows):
        width = rows_for(rows)
        packings.append(engine.decoder.packing)
        return width

    monkeypatch.setattr(engine.decoder, "_packed_rows_for", recording)
    out = run(engine, sampled())
    assert packings and set(packings) == {"mkl"}
    assert torch.equal(out["responses"], plain["responses"])


@pytest.mark.parametrize("params", [sampled(n=4, temperature=1.5, stop_token_ids=tuple(range(2, 40))),
                                    sampled(n=2, top_p=0.9, eos_token_id=EOS)], ids=["rows-finish", "top-p"])
def test_fused_decode_matches_torch_ops(tiny_model, kernels, params):
    # rows finish early (compaction, re-packing, zero-padded rows) and left-padded prompts
    torch_ops = run(NativeRolloutEngine(tiny_model, fused_kernels=False), params)
    engine = NativeRolloutEngine(tiny_model, fused_kernels=True)
    assert engine.decoder.kernels is not None
    fused = run(engine, params)
    assert torch.equal(fused["responses"], torch_ops["responses"])
    assert (fused["rollout_log_probs"] - torch_ops["rollout_log_probs"]).abs().max() < 1e-5
    assert engine.decoder.kernels is not None


def test_samples_read_their_prompt_from_one_shared_copy(tiny_model, kernels, monkeypatch):
    # 4 left-padded prompts x 3 samples, rows finishing early (compaction moves rows and their
    # prompt pointers): the shared cache gives exactly the numbers of per-sample copies
    params = sampled(n=3, temperature=1.5, stop_token_ids=tuple(range(2, 40)))
    copies = NativeRolloutEngine(tiny_model, fused_kernels=True)
    copies.decoder.share_prompts = False
    expected = run(copies, params)
    engine = NativeRolloutEngine(tiny_model, fused_kernels=True)
    selected = []
    monkeypatch.setattr(engine.decoder.cache, "repeat_rows",
                        lambda repeats: repeats == 1 or pytest.fail("prompt rows were copied"))
    select = engine.decoder.cache.select
    monkeypatch.setattr(engine.decoder.cache, "select", lambda keep: (selected.append(keep.numel()), select(keep)))
    out = run(engine, params)
    cache = engine.decoder.cache
    assert cache.source is not None and selected  # shared, and rows were dropped
    assert torch.equal(out["responses"], expected["responses"])
    assert torch.equal(out["rollout_log_probs"], expected["rollout_log_probs"])
    assert (out["response_mask"].sum(-1) < params.max_new_tokens).any()
    one = run(engine, sampled(n=1))  # one sample per prompt: nothing to share
    assert cache.source is None and cache.prompt_store is None and one["responses"].shape[0] == 4


def test_fused_decode_logits_match_torch_ops_on_padded_prompts(tiny_model, kernels):
    prompts = make_prompts(num=3, length=7, seed=4)
    logits = {}
    for fused in (False, True):
        decoder = CompactDecoder(tiny_model, fused_kernels=fused)
        with torch.inference_mode():
            first = decoder.prefill(*prompts.values(), repeats=2, max_new_tokens=4)
            tokens = first.argmax(-1).repeat_interleave(2)
            positions = prompts["position_ids"][:, -1].repeat_interleave(2) + 1
            logits[fused] = [decoder.decode(tokens, positions), decoder.decode(tokens.flip(0), positions + 1)]
    for plain, fused in zip(logits[False], logits[True]):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_rotary_table_rows_equal_the_models_rotary_module(tiny_model, kernels, monkeypatch):
    """The fused step reads cos / sin from a per-rollout table: bit-identical to the module's own at
    every position it decodes, and the module is not called per step (a dynamic rope type keeps it)."""
    decoder = CompactDecoder(tiny_model, fused_kernels=True)
    prompts = make_prompts(num=3, length=7, seed=4)
    rotary = tiny_model.model.rotary_emb
    with torch.inference_mode():
        decoder.prefill(*prompts.values(), repeats=2, max_new_tokens=5)
        cos_table, sin_table = decoder.rope_table
        positions = torch.arange(cos_table.shape[0])
        cos, sin = rotary(torch.zeros(1, 1, tiny_model.config.hidden_size), positions[None])
        assert torch.equal(cos_table, cos[0]) and torch.equal(sin_table, _signed_sin(sin[0]))
        assert cos_table.shape[0] > int(prompts["position_ids"].max()) + 4  # the last decoded position
        calls = []
        monkeypatch.setattr(rotary, "forward", lambda *args: calls.append(args) or pytest.fail("rotary per step"))
        tokens = torch.zeros(6, dtype=torch.long)
        decoder.decode(tokens, prompts["position_ids"][:, -1].repeat_interleave(2) + 1)
        monkeypatch.undo()
    monkeypatch.setattr(rotary, "rope_type", "dynamic", raising=False)
    assert not decoder.rope_tabulated
    with torch.inference_mode():
        decoder.prefill(*prompts.values(), repeats=2, max_new_tokens=5)
    assert decoder.rope_table is None


def test_kernels_are_off_where_they_do_not_apply(tiny_model, kernels):
    bf16 = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert CompactDecoder(bf16).kernels is None  # default: quietly off
    with pytest.raises(ValueError, match="fp32 CPU weights"):
        CompactDecoder(bf16, fused_kernels=True)
    with pytest.raises(ValueError, match="compact decoder"):
        NativeRolloutEngine(tiny_model, compact=False, fused_kernels=True)
    assert CompactDecoder(tiny_model, fused_kernels=False).kernels is None


def test_load_falls_back_without_a_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("HYBRIDRL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hybridrl.rollout.cpu_kernels"):
            assert cpu_kernels.load() is None
        assert "no C compiler found" in caplog.text and "no-such-cc" in caplog.text
        monkeypatch.delenv("CC")
        monkeypatch.setenv("HYBRIDRL_CPU_KERNELS", "0")
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load() is None  # switched off: not even built
        assert list(tmp_path.iterdir()) == []
    finally:
        cpu_kernels.load.cache_clear()


def test_build_reports_compiler_errors(monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    monkeypatch.setenv("HYBRIDRL_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="broken.c"):
        cpu_kernels.build_and_load()
    assert not any((tmp_path / "cache").glob("*.so"))  # no half-built library left behind


@pytest.mark.parametrize(("vocab", "temperature", "greedy"), [(1000, 1.0, False), (49152, 0.7, False), (777, 1.0, True)])
def test_select_tokens_matches_torch_ops(kernels, monkeypatch, vocab, temperature, greedy):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=gen) * 3
    uniforms = 1.0 - torch.rand(64, generator=gen)
    params = SamplingParams(temperature=temperature, do_sample=not greedy)
    assert sampling._kernels_for(logits, params) is not None
    fused = sampling.select_tokens(logits, params, uniforms)
    monkeypatch.setattr(sampling, "_kernels_for", lambda logits, params: None)
    plain = sampling.select_tokens(logits, params, uniforms)
    same = fused[0] == plain[0]
    # torch's own float32 log_softmax over 49152 logits is off by up to 1.3e-5 on an AVX2 build (the
    # kernel sums its blocks in double: within 1e-6 of float64 here), so the two paths agree to 3e-5
    torch.testing.assert_close(fused[1][same], plain[1][same], rtol=1e-5, atol=3e-5)
    exact = torch.log_softmax(logits.double() / (temperature if not greedy else 1.0), -1)
    torch.testing.assert_close(fused[1].double(), exact.gather(-1, fused[0][:, None]).squeeze(-1), rtol=0, atol=1e-5)
    if greedy or vocab <= 1000:
        assert torch.equal(fused[0], plain[0])
    if not greedy:
        # the token's slice of the cumulative distribution (float64) holds u, to 1e-6 of the mass:
        # with 49152 tokens many weigh ~1e-9, below float32's resolution of torch's own cumsum
        # (~6e-8 here), so the two paths may pick different neighbours in the tail
        cdf = torch.cumsum(torch.softmax(logits.double() / temperature, -1), -1)
        upper = cdf.gather(-1, fused[0][:, None]).squeeze(-1)
        lower = upper - torch.softmax(logits.double() / temperature, -1).gather(-1, fused[0][:, None]).squeeze(-1)
        target = uniforms.double() * cdf[:, -1]
        assert ((lower - 1e-6 <= target) & (target <= upper + 1e-6)).all()
        assert (fused[0] != plain[0]).sum() <= 2


def test_select_tokens_never_picks_a_zero_probability_token(kernels):
    logits = torch.randn(4, 600, generator=torch.Generator().manual_seed(3))
    logits[:, :5] = float("-inf")
    logits[:, 300:] = float("-inf")  # zero weight after token 299: u = 1 must land on 299's side
    uniforms = torch.tensor([1.0, 1e-12, 0.5, 1.0])
    tokens, log_probs = sampling.select_tokens(logits, SamplingParams(temperature=1.0), uniforms)
    assert tokens[0] == tokens[3] == 299 and tokens[1] == 5 and 5 <= tokens[2] < 300
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(sampling.select_tokens(logits, SamplingParams(do_sample=False), None)[0], logits.argmax(-1))


def test_select_tokens_uses_torch_ops_for_filters(kernels):
    logits = torch.randn(2, 50)
    assert sampling._kernels_for(logits, SamplingParams(top_k=5)) is None
    assert sampling._kernels_for(logits, SamplingParams(top_p=0.9)) is None
    assert sampling._kernels_for(logits.double(), SamplingParams()) is None
    assert sampling._kernels_for(logits, SamplingParams(top_k=50)) is not None  # k = vocab filters nothing

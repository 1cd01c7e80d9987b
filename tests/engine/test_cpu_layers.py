"""hybridrl.engine.cpu_layers: the gated MLP's silu(gate) * up, RMSNorm and the rotary embedding
through the CPU kernels against torch's ops, values and gradients, and which models' layers take them."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config
from transformers.models.qwen2 import modeling_qwen2

from hybridrl.engine import cpu_attention, cpu_layers
from hybridrl.engine.cpu_layers import interleave_rows, rms_norm, rope, swiglu, swiglu_fused, use_cpu_layers
from hybridrl.models import make_tiny_model_dir
from hybridrl.utils.cpu_matmul import use_onednn_linears
from tests.engine.helpers import build_model, tiny_config

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="CPU kernels not built here (AVX-512 or AVX2 + FMA)")


def _same_on_one_and_two_threads(run):
    """``run()``'s tensors are the same floats on one thread and on two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def _both(gate, up, grad):
    """(output, gate's gradient, up's gradient) of ``swiglu`` and of torch's ops."""
    results = []
    for fn in (swiglu, lambda g, u: F.silu(g) * u):
        g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
        out = fn(g, u)
        out.backward(grad)
        results.append((out.detach(), g.grad, u.grad))
    return results


@pytest.mark.parametrize("shape", [(7,), (3, 17, 33), (128, 384), (9000, 3)])
def test_values_and_gradients_match_torch(shape):
    """Sizes that are and are not multiples of the kernels' 16 floats, and more than one parallel
    chunk (4096 floats); gates as large as an activation gets, both signs."""
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(shape, generator=gen) * s for s in (6.0, 1.0, 1.0))
    mine, ref = _both(gate, up, grad)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_extreme_gates_give_torchs_limits():
    """silu(g) -> 0 far below zero (no overflow of exp(-g) into inf / inf), -> g far above; a NaN
    gate stays NaN."""
    gate = torch.tensor([-1e4, -100.0, -88.5, -87.0, 0.0, 87.0, 100.0, 1e4, float("nan")])
    up = torch.full_like(gate, 2.0)
    mine, ref = _both(gate, up, torch.ones_like(gate))
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-30, equal_nan=True)


def test_strided_operands_and_two_threads():
    """Transposed views are read as their values; two threads give the same floats as one."""
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(300, 200, generator=gen).t(), torch.randn(300, 200, generator=gen).t()
    grad = torch.randn(200, 300, generator=gen)
    torch.testing.assert_close(swiglu(gate, up), F.silu(gate) * up, rtol=2e-6, atol=2e-6)
    _same_on_one_and_two_threads(lambda: _both(gate, up, grad)[0])


def test_other_dtypes_take_torchs_ops():
    gate, up = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    assert not cpu_attention.swiglu_usable(gate, up)
    assert not cpu_attention.swiglu_usable(torch.randn(5, 8), torch.randn(8, 5))
    assert torch.equal(swiglu(gate, up), F.silu(gate) * up)


def test_compiled_function_has_no_graph_break():
    """The ops are opaque to torch.compile: one graph, the same numbers as eager."""
    from torch._dynamo.utils import counters

    def mlp(x, w_gate, w_up):
        return rms_norm(swiglu(x @ w_gate, x @ w_up), w_up[0], 1e-6).sum(-1)

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(2)
    x, w_gate, w_up = torch.randn(6, 8, generator=gen), torch.randn(8, 24, generator=gen), torch.randn(8, 24, generator=gen)
    compiled = torch.compile(mlp, dynamic=True)
    torch.testing.assert_close(compiled(x, w_gate, w_up), mlp(x, w_gate, w_up))
    assert sum(counters["graph_break"].values()) == 0


def _arch_model(arch: str, **overrides):
    """A tiny model of ``arch`` (the test config's sizes), seeded: two calls give the same weights."""
    torch.manual_seed(0)
    if arch == "qwen2":
        return build_model(**overrides)
    base = {k: v for k, v in (tiny_config().to_diff_dict() | overrides).items()
            if k not in ("model_type", "architectures", "transformers_version")}
    config = {"llama": LlamaConfig, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch](**base)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _logits_and_grads(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits  # as the engine runs it
    logits.square().mean().backward()
    return logits.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize(("arch", "onednn"), [("qwen2", False), ("qwen2", True), ("llama", False),
                                              ("qwen3", True), ("mistral", False)])
def test_fused_models_match_unfused(arch, onednn, monkeypatch):
    """Every MLP and norm of the model takes the ops, and (inputs narrower than FUSE_MAX_INPUT) its
    gate and up, and its attention's q, k and v, run as one product each; logits and parameter
    gradients equal those of the same model with torch's ops, and the state dict is untouched.
    Qwen2's projections have biases, Qwen3's attention normalises q and k."""
    fused, plain = _arch_model(arch), _arch_model(arch)
    if onednn:
        for model in (fused, plain):
            use_onednn_linears(model, force=True)
    layers = fused.config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)
    assert use_cpu_layers(fused) == {"mlp": layers, "norm": norms, "rope": layers, "qkv": layers}
    assert list(fused.state_dict()) == list(plain.state_dict())
    widths = []
    real = cpu_layers._product
    monkeypatch.setattr(cpu_layers, "_product", lambda kind, x, w, b: widths.append(w.shape[0]) or real(kind, x, w, b))
    ids = torch.randint(1, 90, (3, 11), generator=torch.Generator().manual_seed(3))
    ours, theirs = _logits_and_grads(fused, ids), _logits_and_grads(plain, ids)
    attn, config = fused.model.layers[0].self_attn, fused.config
    qkv = attn.q_proj.out_features + 2 * attn.k_proj.out_features
    assert sorted(widths) == sorted([qkv, 2 * config.intermediate_size] * layers)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_generation_with_a_cache_takes_transformers_attention(monkeypatch):
    """The one-product attention runs only without a key-value cache: generate's calls (with one) go
    to transformers' forward, and the tokens are the unfused model's."""
    fused, plain = build_model(), build_model()
    use_cpu_layers(fused)
    widths = []
    real = cpu_layers._product
    monkeypatch.setattr(cpu_layers, "_product", lambda kind, x, w, b: widths.append(w.shape[0]) or real(kind, x, w, b))
    ids = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(4))
    outs = [m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
            for m in (fused, plain)]
    assert torch.equal(outs[0], outs[1])
    assert widths and set(widths) == {2 * fused.config.intermediate_size}  # the MLPs only


def test_wide_or_hooked_projections_stay_separate(monkeypatch):
    """Inputs wider than FUSE_MAX_INPUT keep one product per projection (their weights' copies cost
    more than one product saves); so do projections with a hook, which the one product would skip,
    and attentions without the attributes the forward passes on (an older transformers')."""
    widths = []
    real = cpu_layers._product
    monkeypatch.setattr(cpu_layers, "_product", lambda kind, x, w, b: widths.append(w.shape[0]) or real(kind, x, w, b))
    ids = torch.randint(1, 90, (2, 7), generator=torch.Generator().manual_seed(5))
    wide = build_model(hidden_size=cpu_layers.FUSE_MAX_INPUT + 32, intermediate_size=64)
    assert use_cpu_layers(wide)["qkv"] == 0
    wide(input_ids=ids, use_cache=False)
    assert widths == []
    model = build_model()
    layers = model.config.num_hidden_layers
    del model.model.layers[0].self_attn.sliding_window  # as a forward that reads no such attribute
    assert use_cpu_layers(model)["qkv"] == layers - 1
    assert use_cpu_layers(build_model())["qkv"] == layers
    model = build_model()
    use_cpu_layers(model)
    seen = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda *a: seen.append("up"))
    model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *a: seen.append("k"))
    model(input_ids=ids, use_cache=False)
    assert seen == ["k", "up"] and len(widths) == 2 * (layers - 1)  # the other layers' two products


def _interleaved_reference(gate_up):
    """gate and up of a fused product's rows (GATE_UP_BLOCK of each in turn), by torch's ops."""
    gate, up = gate_up.unflatten(-1, (-1, 2, cpu_attention.GATE_UP_BLOCK)).unbind(-2)
    return F.silu(gate.flatten(-2)) * up.flatten(-2)


def test_interleave_rows_alternates_blocks():
    a, b = torch.arange(32.0)[:, None], -torch.arange(32.0)[:, None] - 1
    rows = interleave_rows(a, b).squeeze(1).tolist()
    assert rows == list(range(16)) + [-x - 1 for x in range(16)] + list(range(16, 32)) + [-x - 1 for x in range(16, 32)]
    assert torch.equal(interleave_rows(torch.arange(32.0), torch.arange(32.0) + 100)[16:32], torch.arange(16.0) + 100)


@pytest.mark.parametrize("shape", [(32,), (3, 5, 64), (1000, 768)])
def test_fused_swiglu_matches_torch(shape):
    """Values and the gradient (laid out as the fused rows) against torch's ops on the de-interleaved
    halves; one and many rows, more than one parallel chunk; two threads give the same floats."""
    gen = torch.Generator().manual_seed(7)
    gate_up = torch.randn(shape, generator=gen) * 4
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
    assert cpu_attention.swiglu_fused_usable(gate_up)

    def both():
        results = []
        for fn in (swiglu_fused, _interleaved_reference):
            x = gate_up.detach().clone().requires_grad_()
            out = fn(x)
            out.backward(grad)
            results.append((out.detach(), x.grad))
        return results

    mine, ref = both()
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    _same_on_one_and_two_threads(lambda: both()[0])


def test_swiglu_outputs_past_the_streaming_size_are_the_same_floats():
    """Outputs of 2^21 floats and more are written with streaming stores: the same floats as the same
    rows in calls below that size, plain and fused, values and gradients."""
    gen = torch.Generator().manual_seed(11)
    rows, cols = 1500, 1536  # 2.3 M floats an output; thirds of 0.77 M
    gate, up, grad = (torch.randn(rows, cols, generator=gen) * s for s in (4.0, 1.0, 1.0))
    whole, ref = _both(gate, up, grad)
    thirds = [_both(gate[i:i + 500], up[i:i + 500], grad[i:i + 500])[0] for i in range(0, rows, 500)]
    for k in range(3):
        assert torch.equal(whole[k], torch.cat([part[k] for part in thirds]))
        torch.testing.assert_close(whole[k], ref[k], rtol=2e-6, atol=2e-6)

    gate_up = torch.randn(rows, 2 * cols, generator=gen) * 4

    def fused(x, g):
        x = x.detach().clone().requires_grad_()
        out = swiglu_fused(x)
        out.backward(g)
        return out.detach(), x.grad

    whole = fused(gate_up, grad)
    thirds = [fused(gate_up[i:i + 500], grad[i:i + 500]) for i in range(0, rows, 500)]
    for k in range(2):
        assert torch.equal(whole[k], torch.cat([part[k] for part in thirds]))
    torch.testing.assert_close(whole[0], _interleaved_reference(gate_up), rtol=2e-6, atol=2e-6)


def test_fused_swiglu_leaves_other_widths_and_dtypes_to_torch():
    x48, x64 = torch.randn(4, 48), torch.randn(4, 64, dtype=torch.float64)
    assert not cpu_attention.swiglu_fused_usable(x48) and not cpu_attention.swiglu_fused_usable(x64)
    torch.testing.assert_close(swiglu_fused(x64), _interleaved_reference(x64))


def test_other_activations_are_left_alone(monkeypatch):
    """A GELU-gated MLP is not a SwiGLU (its norms still take the kernels); without the kernels
    nothing is changed."""
    gelu = build_model(hidden_act="gelu")
    layers = gelu.config.num_hidden_layers
    assert use_cpu_layers(gelu) == {"mlp": 0, "norm": 2 * layers + 1, "rope": layers, "qkv": layers}
    assert all("forward" not in vars(m) for m in gelu.modules() if type(m).__name__.endswith("MLP"))
    monkeypatch.setattr(cpu_attention, "_library", lambda: None)
    model = build_model()
    assert use_cpu_layers(model) == {"mlp": 0, "norm": 0, "rope": 0, "qkv": 0}
    assert all("forward" not in vars(m) for m in model.modules())


def _rms_reference(x, weight, eps):
    """transformers' RMSNorm forward."""
    h = x.to(torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _norm_both(x, weight, grad, eps=1e-6):
    results = []
    for fn in (rms_norm, _rms_reference):
        xi, wi = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        out = fn(xi, wi, eps)
        out.backward(grad)
        results.append((out.detach(), xi.grad, wi.grad))
    return results


@pytest.mark.parametrize("shape", [(5,), (3, 7, 20), (300, 128), (2, 9, 576), (1000, 33)])
def test_rms_norm_matches_torch(shape):
    """Widths that are and are not multiples of 16, rows in one and in many blocks of the weight's
    partial sums; inputs of different scales per row."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen).mul(10)
    weight, grad = torch.randn(shape[-1], generator=gen), torch.randn(shape, generator=gen)
    mine, ref = _norm_both(x, weight, grad)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rms_norm_same_floats_on_two_threads_and_other_dtypes_take_torch():
    gen = torch.Generator().manual_seed(5)
    x, weight, grad = torch.randn(700, 96, generator=gen), torch.randn(96, generator=gen), torch.randn(700, 96, generator=gen)
    _same_on_one_and_two_threads(lambda: _norm_both(x, weight, grad)[0])
    x64 = x.double()
    assert not cpu_attention.rms_norm_usable(x64, weight.double())
    assert torch.equal(rms_norm(x64, weight.double(), 1e-6), _rms_reference(x64, weight.double(), 1e-6))


# ------------------------------------------------------------------------ rotary embedding
def _transformers_rope():
    """transformers' own apply_rotary_pos_emb, whether or not use_cpu_layers has stood in for it."""
    fn = modeling_qwen2.apply_rotary_pos_emb
    return getattr(fn, "hybridrl_original", fn)


def _rope_operands(b, heads, kv_heads, t, d, cos_rows, seed=0):
    """q, k as the attention makes them (its projections' (b, t, heads * d) outputs viewed as (b, heads,
    t, d)), and cos, sin (cos_rows, t, d) as its rotary embedding does (two copies of the frequencies)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, heads * d, generator=gen).view(b, t, heads, d).transpose(1, 2)
    k = torch.randn(b, t, kv_heads * d, generator=gen).view(b, t, kv_heads, d).transpose(1, 2)
    pos = torch.randint(0, 500, (cos_rows, t), generator=gen).float()
    freqs = pos[..., None] / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat([freqs, freqs], -1)
    return q, k, emb.cos(), emb.sin()


@pytest.mark.parametrize(("b", "heads", "kv_heads", "d", "cos_rows"), [(2, 4, 2, 32, 2), (1, 3, 3, 64, 1), (3, 2, 1, 96, 1)])
def test_rope_equals_transformers_floats_forward_and_backward(b, heads, kv_heads, d, cos_rows):
    """The kernel makes the same floats as transformers' eager rotary embedding (one product, one
    product and one addition each way), in the projections' layout, and its gradients likewise;
    on one thread and on two."""
    q, k, cos, sin = _rope_operands(b, heads, kv_heads, 13, d, cos_rows)
    grads = torch.randn(q.shape), torch.randn(k.shape)

    def run(fn):
        qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        out = fn(qq, kk, cos, sin)
        torch.autograd.backward(out, grads)
        return out[0].detach(), out[1].detach(), qq.grad, kk.grad

    ours, theirs = run(rope), run(_transformers_rope())
    for a, b_ in zip(ours, theirs):
        assert torch.equal(a, b_)
    assert ours[0].stride() == q.stride()  # the forward keeps the layout the attention reads
    _same_on_one_and_two_threads(lambda: run(rope))


def test_rope_leaves_what_it_does_not_take_to_transformers():
    """None (the dispatcher then calls transformers' function) for a head size not a multiple of 32,
    another unsqueeze_dim, bf16, cos with a gradient, or cos for other positions."""
    q, k, cos, sin = _rope_operands(1, 2, 2, 5, 32, 1)
    assert rope(q, k, cos, sin) is not None
    q48, k48, cos48, sin48 = _rope_operands(1, 2, 2, 5, 48, 1)
    assert rope(q48, k48, cos48, sin48) is None
    assert rope(q, k, cos, sin, unsqueeze_dim=2) is None
    assert rope(q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16()) is None
    assert rope(q, k, cos.clone().requires_grad_(), sin) is None
    assert rope(q, k, cos[:, :4], sin[:, :4]) is None


def test_use_cpu_layers_points_the_modeling_modules_rope_at_the_kernel_once():
    """The attention's forward calls its modeling module's global apply_rotary_pos_emb: after
    use_cpu_layers that is hybridrl's dispatcher (transformers' function behind it), set once however
    many models take it, and a model's logits are those of transformers' function."""
    model = build_model()
    use_cpu_layers(model)
    patched = modeling_qwen2.apply_rotary_pos_emb
    assert patched.hybridrl_original is _transformers_rope() and not hasattr(patched.hybridrl_original,
                                                                           "hybridrl_original")
    use_cpu_layers(build_model())
    assert modeling_qwen2.apply_rotary_pos_emb is patched
    q, k, cos, sin = _rope_operands(1, 2, 2, 5, 48, 1)  # a size the kernel leaves: transformers' answer
    assert all(torch.equal(a, b) for a, b in zip(patched(q, k, cos, sin), _transformers_rope()(q, k, cos, sin)))
    ids = torch.randint(1, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        modeling_qwen2.apply_rotary_pos_emb = patched.hybridrl_original
        try:
            theirs = model(input_ids=ids).logits
        finally:
            modeling_qwen2.apply_rotary_pos_emb = patched
    assert torch.equal(ours, theirs)


def test_a_loaded_models_layers_keep_the_kernels_through_train_and_eval(tmp_path, monkeypatch):
    """transformers (with ``kernels`` installed) kernelizes a model ``from_pretrained`` loads, and again
    at each change between train() and eval(), resetting the RMSNorms' forwards to their class's. A
    model loaded without hybridrl's loaders (which turn that off) keeps the kernels in every norm and
    MLP after use_cpu_layers, in either mode."""
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model_dir(tmp_path / "tiny"), dtype=torch.float32)
    counts = use_cpu_layers(model)
    assert counts["norm"] == 7 and counts["mlp"] == 3
    calls = []
    for name in ("rms_norm", "swiglu_fused"):
        real = getattr(cpu_attention, name)
        monkeypatch.setattr(cpu_attention, name, lambda *args, real=real, name=name: calls.append(name) or real(*args))
    ids = torch.randint(3, 900, (2, 7), generator=torch.Generator().manual_seed(0))
    for mode in (True, False, True):
        model.train(mode)
        calls.clear()
        model(input_ids=ids)
        assert calls.count("rms_norm") == counts["norm"] and calls.count("swiglu_fused") == counts["mlp"], mode


def test_rope_compiles_with_its_layouts():
    """Compiled, the op's declared output layouts are the ones it makes (inductor checks them; the
    products after it hand the backward gradients in another layout than the one it returns), and
    the values and gradients are eager's to the products' rounding."""
    q, k, cos, sin = _rope_operands(2, 4, 2, 7, 32, 2, seed=5)
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(6))

    def after(a, b):
        return tuple(x @ w for x in rope(a, b, cos, sin))

    results = []
    for fn in (torch.compile(after, fullgraph=True), after):
        qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        out = fn(qq, kk)
        (out[0].sum() + out[1].square().sum()).backward()
        results.append((*[o.detach() for o in out], qq.grad, kk.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # the products may round differently compiled

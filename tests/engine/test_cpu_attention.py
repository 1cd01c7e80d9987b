"""hybridrl.engine.cpu_attention: the trainer's CPU attention kernels against torch's
scaled_dot_product_attention, values and gradients, and where they hand over to it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridrl.engine import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="CPU attention kernels not built here (AVX-512 or AVX2 + FMA)")


def _reference(q, k, v, mask, scale):
    """torch's attention, keys/values repeated per query head; (B, T, H, D) like the kernels."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def _operands(b, h, kvh, t, s, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # the query as the model makes it: (B, T, H, D) in memory, viewed as (B, H, T, D)
    q = torch.randn(b, t, h, d, generator=gen).transpose(1, 2).requires_grad_()
    k = torch.randn(b, kvh, s, d, generator=gen).requires_grad_()
    v = torch.randn(b, kvh, s, d, generator=gen).requires_grad_()
    return q, k, v, gen


def _prefix_mask(b, t, p, gen):
    """Shared prompts' response pass: each row's prompt keys (some padding), then its own causally."""
    prompt = torch.rand(b, p, generator=gen) > 0.25
    prompt[:, -1] = True
    own = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.cat([prompt[:, None, None, :].expand(b, 1, t, p), own.expand(b, 1, t, t)], dim=3)


def _check(q, k, v, mask, scale, rows=None):
    out = cpu_attention.attention(q, k, v, mask, scale)
    ref = _reference(q, k, v, mask, scale)
    assert out.shape == ref.shape and out.is_contiguous()
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    if rows is not None:  # compare only rows that may attend somewhere
        ref = ref * rows[:, :, None, None]
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    assert float((out - ref).detach().abs().max()) < 2e-5
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape
        assert float((got - want).abs().max()) < 5e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize(("b", "h", "kvh", "t"), [(2, 4, 2, 13), (1, 9, 3, 40), (3, 2, 2, 1)])
def test_causal_matches_sdpa(b, h, kvh, t, d):
    q, k, v, _ = _operands(b, h, kvh, t, t, d)
    _check(q, k, v, None, d**-0.5)


@pytest.mark.parametrize(("t", "p"), [(63, 14), (7, 50), (33, 1)])
def test_shared_prompt_mask_matches_sdpa(t, p):
    q, k, v, gen = _operands(4, 8, 4, t, p + t, 64, seed=t)
    _check(q, k, v, _prefix_mask(4, t, p, gen), 0.125)


def test_mask_shared_by_all_rows_and_gaps_in_the_middle():
    q, k, v, gen = _operands(3, 4, 1, 21, 70, 32)
    mask = torch.rand(1, 1, 21, 70, generator=gen) > 0.5  # (1, ...): one mask for every row
    mask[..., 0] = True
    _check(q, k, v, mask, 0.3)


def test_a_query_with_no_key_gets_zeros_and_no_gradient():
    q, k, v, _ = _operands(2, 4, 2, 12, 12, 32)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :5] = False  # left padding: row 0's first five queries may attend to nothing
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    out = cpu_attention.attention(q, k, v, mask, 0.2)
    assert torch.equal(out[0, :5], torch.zeros(5, 4, 32))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[0, :, :5], torch.zeros(4, 5, 32))
    rows = torch.ones(2, 12)
    rows[0, :5] = 0
    for t in (q, k, v):
        t.grad = None
    _check(q, k, v, mask, 0.2, rows=rows)


def test_threads_give_the_same_numbers():
    q, k, v, gen = _operands(4, 8, 4, 30, 44, 64)
    mask = _prefix_mask(4, 30, 14, gen)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = cpu_attention.attention(q, k, v, mask, 0.125)
            results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results):
        assert torch.equal(one, two)  # each (row, kv head) is one thread's work, in a fixed order


def _flat(prompts, width, rows, fed, heads, d, gen):
    """(1, heads, N, D) views of the flat (1, N, heads, D) layout the projections make, N = U width + b fed."""
    return torch.randn(1, prompts * width + rows * fed, heads, d, generator=gen).transpose(1, 2).requires_grad_()


@pytest.mark.parametrize(("h", "kvh", "d", "width", "fed", "padded"),
                         [(4, 2, 32, 16, 63, True), (9, 3, 64, 5, 7, False), (2, 2, 16, 1, 20, False)])
def test_shared_prompt_attention_equals_rows_with_their_prompts_gathered(h, kvh, d, width, fed, padded):
    """One flat sequence of prompts then rows (hybridrl.engine.shared_prefix): the prompts attend
    causally over themselves, each row over its prompt's keys (read in place) then its own. Values
    and gradients equal ``attention`` on the prompts and on the rows with their prompts' keys and
    values gathered in front of their own, as the shared-prompt forward computed them before."""
    gen = torch.Generator().manual_seed(width + fed)
    group = torch.tensor([0, 2, 1, 2, 0, 2, 1])  # rows per prompt in any order, a prompt of three rows
    prompts, rows = 3, len(group)
    q, k, v = (_flat(prompts, width, rows, fed, n, d, gen) for n in (h, kvh, kvh))
    causal = torch.ones(max(width, fed), max(width, fed), dtype=torch.bool).tril()
    real = torch.ones(prompts, width, dtype=torch.bool)
    if padded:
        real[1, :3] = False  # a left-padded prompt; its padding queries see themselves
    prompt_mask = (causal[:width, :width] & (real[:, None, :] | torch.eye(width, dtype=torch.bool)))[:, None]
    own = torch.ones(rows, 1, 1, fed, dtype=torch.bool) & causal[:fed, :fed]
    own[3, 0, 0, fed - 2:] = False  # a row's padding at the end of its response
    rows_mask = torch.cat([real[group][:, None, None, :].expand(-1, 1, fed, -1), own], dim=3)
    out = cpu_attention.shared_prompt_attention(q, k, v, group, prompt_mask if padded else None, rows_mask,
                                                d**-0.5)
    cut = prompts * width

    def parts(x):
        return x[:, :, :cut].unflatten(2, (prompts, width))[0].transpose(0, 1), \
            x[:, :, cut:].unflatten(2, (rows, fed))[0].transpose(0, 1)

    (qp, qr), (kp, kr), (vp, vr) = parts(q), parts(k), parts(v)
    ref_prompts = cpu_attention.attention(qp, kp, vp, prompt_mask if padded else None, d**-0.5)
    keys, values = (torch.cat([p.index_select(0, group), r], dim=2) for p, r in ((kp, kr), (vp, vr)))
    ref_rows = cpu_attention.attention(qr, keys, values, rows_mask, d**-0.5)
    ref = torch.cat([ref_prompts.flatten(0, 1), ref_rows.flatten(0, 1)])[None]
    assert out.shape == (1, cut + rows * fed, h, d) and out.is_contiguous()
    assert float((out - ref).detach().abs().max()) < 1e-6
    upstream = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    for got, want in zip(grads, ref_grads):
        assert got.is_contiguous()  # the layout a compiled block's backward takes: no copy on the way back
        assert float((got - want).abs().max()) < 1e-5 * max(1.0, float(want.abs().max()))
    assert float(grads[1][:, :, :cut].abs().max()) > 0  # the prompts' keys get their rows' gradients


def test_shared_prompt_attention_refuses_a_group_outside_the_prompts():
    gen = torch.Generator().manual_seed(6)
    q, k, v = (_flat(2, 4, 3, 5, n, 16, gen) for n in (2, 2, 2))
    rows_mask = torch.ones(3, 1, 5, 9, dtype=torch.bool)
    with pytest.raises(IndexError, match=r"group ids must lie in \[0, 2\), got 0 .. 2"):
        cpu_attention.shared_prompt_attention(q, k, v, torch.tensor([0, 1, 2]), None, rows_mask, 0.2)


def test_shared_prompt_attention_is_the_same_on_two_threads():
    gen = torch.Generator().manual_seed(5)
    group = torch.tensor([0, 0, 1, 1, 1])
    q, k, v = (_flat(2, 6, 5, 11, n, 32, gen) for n in (4, 2, 2))
    rows_mask = torch.cat([torch.ones(5, 1, 11, 6, dtype=torch.bool),
                           torch.ones(11, 11, dtype=torch.bool).tril().expand(5, 1, 11, 11)], dim=3)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = cpu_attention.shared_prompt_attention(q, k, v, group, None, rows_mask, 0.2)
            results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_usable_and_hf_attention_hand_over_to_sdpa():
    q, k, v, _ = _operands(2, 4, 2, 5, 5, 64)
    assert cpu_attention.usable(q, k, v, None)
    assert not cpu_attention.usable(q[..., :24], k[..., :24], v[..., :24], None)  # head size not a multiple of 16
    assert not cpu_attention.usable(q.double(), k.double(), v.double(), None)
    assert not cpu_attention.usable(q, k, v, torch.zeros(2, 1, 5, 5))  # a float (additive) mask

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    module = Attn()
    mine, _ = cpu_attention.hf_attention(module, q, k, v, None, scaling=0.125)
    # dropout is not in the kernels: transformers' sdpa runs (and with p=1 zeroes everything)
    dropped, _ = cpu_attention.hf_attention(module, q, k, v, None, dropout=1.0, scaling=0.125)
    assert torch.equal(dropped, torch.zeros_like(dropped))
    assert float((mine - _reference(q, k, v, None, 0.125)).detach().abs().max()) < 2e-5


def _threads(n, fn):
    """fn() on n torch threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (1, 37), (37, 1), (16, 16), (33, 50), (656, 192), (100, 130),
                                           (2048, 1030), (2050, 1024)])
def test_transposed_equals_torchs_transposed_copy(rows, cols, threads):
    # whole 16 x 16 blocks, tails in either dimension, single rows and columns, a row stride past the
    # width; past 2 M floats with whole blocks of rows the streaming stores, and without them
    x = torch.randn(rows, cols + 3, generator=torch.Generator().manual_seed(rows * cols))[:, :cols]
    out = _threads(threads, lambda: cpu_attention.transposed(x))
    assert out.shape == (cols, rows) and out.is_contiguous() and torch.equal(out, x.t().contiguous())


def test_transposed_hands_other_tensors_to_torch():
    for x in (torch.randn(5, 7).t(), torch.randn(4, 6, dtype=torch.float64), torch.zeros(0, 3)):
        assert torch.equal(cpu_attention.transposed(x), x.t().contiguous())


@pytest.mark.parametrize(("rows", "out", "inner"), [
    (8346, 128, 128), (8346, 64, 128), (8346, 1024, 128), (8346, 128, 384),  # the tiny benchmark model's
    (300, 13, 48),  # an output tile of 5 rows, a last 16 columns past the 32-wide tiles (AVX-512)
    (1, 8, 16), (3, 1, 32),  # a single row, a single output
    (1300, 40, 48),  # chunks of 512 rows (the most), the last one partial
    (700, 1030, 16), (100, 2048, 16),  # tall outputs: chunks of 62 rows, of 32 (the fewest)
    (0, 24, 64),  # nothing to sum: zeros
])
def test_weight_grad_matches_float64_on_any_number_of_threads(rows, out, inner):
    gen = torch.Generator().manual_seed(rows + out + inner)
    # rows further apart than their width, as a linear's input can be (a column slice)
    grad = torch.randn(rows, out + 5, generator=gen)[:, :out]
    x = torch.randn(rows, inner + 16, generator=gen)[:, :inner]
    (one, bias_one), (two, bias_two) = (_threads(n, lambda: cpu_attention.weight_grad(grad, x, True)) for n in (1, 2))
    assert one.shape == (out, inner) and one.is_contiguous() and bias_one.shape == (out,)
    expected, expected_bias = grad.double().t() @ x.double(), grad.double().sum(0)
    scale = max(float(expected.abs().max()), 1.0)
    assert float((one.double() - expected).abs().max()) / scale < 1e-5
    assert float((bias_one.double() - expected_bias).abs().max()) < 1e-5 * max(rows, 1) ** 0.5
    # each output one thread's, summed over rows in order; the bias's too
    assert torch.equal(one, two) and torch.equal(bias_one, bias_two)
    plain, no_bias = cpu_attention.weight_grad(grad, x)
    assert torch.equal(plain, one) and no_bias is None


@pytest.mark.parametrize(("rows", "inner", "out", "bias", "transposed_weight"), [
    (8304, 128, 768, False, False), (8304, 128, 256, True, False),  # the tiny model's gate-up, q-k-v (bias)
    (8304, 384, 128, False, True),  # its gate-up input gradient: the weight's transposed view
    (1031, 40, 80, True, False),  # a last tile of 5 rows, a last panel of one 16-column vector
    (1030, 7, 16, False, True), (1024, 1, 48, True, False),  # narrow sums, narrow outputs
    # weights past one 512 KB block of panels: 25 panels in blocks of 4 (the last of one panel of
    # one 16-column vector), and a panel of 640 KB, one a block
    (1037, 512, 1552, True, False), (1030, 2560, 80, False, True),
])
def test_linear_matches_float64_on_any_number_of_threads(rows, inner, out, bias, transposed_weight):
    gen = torch.Generator().manual_seed(rows + inner + out)
    x = torch.randn(rows, inner + 3, generator=gen)[:, :inner]  # rows further apart than their width
    weight = torch.randn(inner, out, generator=gen).t() if transposed_weight else torch.randn(out, inner, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    assert cpu_attention.linear_usable(x, weight) == (cpu_attention.simd_width() == 512)
    one, two = (_threads(n, lambda: cpu_attention.linear(x, weight, b)) for n in (1, 2))
    assert one.shape == (rows, out) and one.is_contiguous()
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert float((one.double() - expected).abs().max()) / max(float(expected.abs().max()), 1.0) < 1e-5
    assert torch.equal(one, two)  # each output one thread's, summed in order


def test_linear_usable_takes_the_shapes_it_was_measured_faster_on():
    x, weight = torch.randn(2048, 128), torch.randn(1024, 128)
    fast = cpu_attention.simd_width() == 512
    assert cpu_attention.linear_usable(x, weight) == fast  # the tiny model's LM head
    assert cpu_attention.linear_usable(torch.randn(4144, 512), torch.randn(3072, 512)) == fast  # the 25M's gate-up
    assert not cpu_attention.linear_usable(x[:cpu_attention.LINEAR_MIN_ROWS - 1], weight)  # too few rows
    assert not cpu_attention.linear_usable(x, torch.randn(1000, 128))  # outputs not a multiple of 16
    assert not cpu_attention.linear_usable(torch.randn(2048, 576), torch.randn(49152, 576))  # SmolLM2's LM head
    assert not cpu_attention.linear_usable(x.t().contiguous().t(), weight)  # columns apart
    assert not cpu_attention.linear_usable(x.double(), weight.double())


def test_weight_grad_usable_takes_the_shapes_it_was_measured_faster_on():
    grad, x = torch.randn(64, 1024), torch.randn(64, 128)
    fast = cpu_attention.simd_width() == 512
    assert cpu_attention.weight_grad_usable(grad, x) == fast  # the tiny model's LM head: 128 K outputs
    assert not cpu_attention.weight_grad_usable(torch.randn(64, 1025), x)  # more outputs than stay in L2
    assert not cpu_attention.weight_grad_usable(grad, torch.randn(64, 120))  # inputs not a multiple of 16
    assert not cpu_attention.weight_grad_usable(grad, torch.randn(63, 128))  # another row count
    assert cpu_attention.weight_grad_usable(grad, torch.randn(128, 128)[::2]) == fast  # rows apart: read in place
    assert not cpu_attention.weight_grad_usable(grad.double(), x.double())
    assert not cpu_attention.weight_grad_usable(grad.t().contiguous().t(), x)  # columns apart


def test_turned_off_by_environment():
    code = "from hybridrl.engine import cpu_attention; print(cpu_attention.available())"
    env = {**os.environ, "HYBRIDRL_CPU_ATTENTION": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("share_prompts", [True, False])
def test_train_engine_attends_through_the_kernels_with_sdpa_numbers(monkeypatch, share_prompts):
    """Two engines on the same tiny model and batch (a left-padded prompt, 4 rows sharing each
    prompt): one attending through the kernels, one through sdpa; same losses and gradient norms to
    float rounding, with and without shared prompts."""
    from hybridrl.engine import TrainEngine
    from hybridrl.models import build_tiny_model
    from hybridrl.protocol import DataProto

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 1000, (2, 9), generator=gen).repeat_interleave(4, 0)
    mask = torch.ones(8, 21, dtype=torch.long)
    mask[:4, :3] = 0  # the first prompt is 6 tokens, left-padded
    ids = torch.cat([prompts, torch.randint(3, 1000, (8, 12), generator=gen)], dim=1) * mask
    data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                                        "responses": ids[:, 9:].clone()})
    calls = []
    kernel = cpu_attention._run_forward  # the ops' (rows apart / shared prompts) call into the kernels
    monkeypatch.setattr(cpu_attention, "_run_forward", lambda *a: calls.append(1) or kernel(*a))
    results = {}
    for kernels in (True, False):
        if not kernels:  # as on a machine without them: sdpa everywhere, shared prompts included
            monkeypatch.setattr(cpu_attention, "_library", lambda: None)
        torch.manual_seed(0)
        engine = TrainEngine(build_tiny_model("tiny"), lr=1e-3, share_prompts=share_prompts)
        switched = engine.model.config._attn_implementation == cpu_attention.ATTENTION_NAME
        assert switched == kernels
        before = len(calls)
        metrics = [engine.train_step(data, lambda out, micro: (-out["log_probs"].mean(), {})) for _ in range(2)]
        assert (len(calls) > before) == kernels
        results[kernels] = [(m["loss"], m["grad_norm"]) for m in metrics]
    for (loss, norm), (ref_loss, ref_norm) in zip(results[True], results[False]):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_library_keeps_its_block_requests():
    """The built library holds the attention's cache-line requests: the next block's rows into L1
    (backward) and L2 (forward), the next item's into L2. GCC drops a call to a function that does
    nothing but prefetch, so moving them into such a function compiles them out without a sign."""
    code = subprocess.run(["objdump", "-d", cpu_attention._library()._name], capture_output=True, text=True,
                          check=True).stdout
    assert code.count("prefetcht0") >= 3, "the backward's block requests were compiled out"
    assert code.count("prefetcht1") >= 4, "the forward's block requests or the item requests were compiled out"
    if cpu_attention.simd_width() in (256, 512) and "3dnowprefetch" in Path("/proc/cpuinfo").read_text():
        # a -march=native build on a CPU with prefetchw: the output rows requested for writing
        assert code.count("prefetchw") >= 3, "the requests for the output rows were compiled out"

"""Response log-probs and entropy from a micro-batch's logits: the fused path against plain autograd."""

import math
import weakref

import pytest
import torch

from hybridrl.engine import cpu_attention
from hybridrl.engine.packing import gather_response, pack_rows
from hybridrl.engine.train_engine import _NextTokenLogProb, _token_stats

needs_kernels = pytest.mark.skipif(not cpu_attention.available(), reason="hybridrl's CPU kernels do not build here")


def _reference(logits, packed, first_col, responses, temperature):
    """The textbook computation: align the logits to the responses, then log_softmax and gather."""
    aligned, valid = gather_response(logits, packed, first_col)
    scaled = aligned.float() / temperature
    log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, responses[:, : scaled.shape[1], None]).squeeze(-1)
    probs = torch.softmax(scaled, dim=-1)
    entropy = -(probs * torch.log_softmax(scaled, dim=-1)).sum(-1)
    return torch.where(valid, log_probs, 0.0), torch.where(valid, entropy, 0.0)


def test_next_token_log_prob_matches_autograd_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 4
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    fused = logits.clone().requires_grad_()
    plain = logits.clone().requires_grad_()
    out = _NextTokenLogProb.apply(fused, targets)
    ref = torch.log_softmax(plain, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(out, ref, atol=1e-12)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    assert torch.allclose(fused.grad, plain.grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: _NextTokenLogProb.apply(x, targets),
                                   (logits.clone().requires_grad_(),))


@needs_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(7, 16), (7, 1037), (7, 49152), (1050, 1024)])
def test_fp32_kernels_match_float64_log_softmax_values_and_gradients(rows, vocab, monkeypatch):
    """fp32 CPU logits go through hybridrl's kernels (no log_softmax tensor); values and the
    logits' gradient against float64 autograd within twice torch's own fp32 error, a vocabulary not
    a multiple of 16 included, and a gradient large enough to be written with streaming stores."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(2, rows, vocab, generator=gen) * 5
    targets = torch.randint(0, vocab, (2, rows), generator=gen)
    weights = torch.randn(2, rows, generator=gen)
    calls = []
    forward = cpu_attention.token_logprob
    monkeypatch.setattr(cpu_attention, "token_logprob", lambda *a, **k: calls.append(1) or forward(*a, **k))
    fused = logits.clone().requires_grad_()
    out = _NextTokenLogProb.apply(fused, targets)
    (out * weights).sum().backward()
    exact, torch32 = logits.double().requires_grad_(), logits.clone().requires_grad_()
    ref = torch.log_softmax(exact, -1).gather(-1, targets[..., None]).squeeze(-1)
    (ref * weights.double()).sum().backward()
    plain = torch.log_softmax(torch32, -1).gather(-1, targets[..., None]).squeeze(-1)
    (plain * weights).sum().backward()
    assert calls == [1] and out.dtype == torch.float32

    def error(x, y):
        return float((x.double() - y).abs().max())

    assert error(out, ref.detach()) <= 2 * error(plain.detach(), ref.detach()) + 1e-7
    assert error(fused.grad, exact.grad) <= 2 * error(torch32.grad, exact.grad) + 1e-8


@needs_kernels
def test_fp32_backward_reads_the_kept_exponentials_not_the_logits(monkeypatch):
    """With a backward to come the forward keeps exp(logits - max) and drops the logits (freed with
    their last reference); the backward leaves what it read as it was, so a retained graph's second
    backward gives the same gradient; without one (no_grad) nothing is kept."""
    gen = torch.Generator().manual_seed(3)
    leaf = (torch.randn(3, 5, 100, generator=gen) * 4).requires_grad_()
    targets = torch.randint(0, 100, (3, 5), generator=gen)
    logits = leaf * 1.0
    alive = weakref.ref(logits)
    out = _NextTokenLogProb.apply(logits, targets)
    kept = out.grad_fn.saved_tensors[0]
    torch.testing.assert_close(kept, torch.exp(logits - logits.amax(-1, keepdim=True)), rtol=2e-7, atol=0)
    del logits
    assert alive() is None
    weights = torch.randn(3, 5, generator=gen)
    (out * weights).sum().backward(retain_graph=True)
    first = leaf.grad.clone()
    torch.testing.assert_close(first, torch.func.grad(lambda z: (torch.log_softmax(z, -1).gather(
        -1, targets[..., None]).squeeze(-1) * weights).sum())(leaf.detach()), rtol=1e-5, atol=1e-6)
    leaf.grad = None
    (out * weights).sum().backward()
    assert torch.equal(leaf.grad, first)

    kept_flags = []
    forward = cpu_attention.token_logprob
    monkeypatch.setattr(cpu_attention, "token_logprob",
                        lambda *a, **k: kept_flags.append(k.get("keep_exps")) or forward(*a, **k))
    with torch.no_grad():
        _NextTokenLogProb.apply(leaf, targets, torch.is_grad_enabled())
    _NextTokenLogProb.apply(leaf.detach(), targets)
    _NextTokenLogProb.apply(leaf, targets)
    assert kept_flags == [False, False, True]


@needs_kernels
def test_fp32_kernels_name_a_target_outside_the_vocabulary():
    with pytest.raises(IndexError, match="target token id 40 outside the logits' vocabulary of 32"):
        _NextTokenLogProb.apply(torch.randn(2, 3, 32), torch.tensor([[1, 2, 3], [4, 40, 5]]))


def test_other_logits_keep_torchs_path(monkeypatch):
    monkeypatch.setattr(cpu_attention, "token_logprob", lambda *a: pytest.fail("kernel called"))
    logits = torch.randn(4, 3, 32).transpose(0, 1)  # not contiguous
    targets = torch.randint(0, 32, (3, 4))
    out = _NextTokenLogProb.apply(logits, targets)
    torch.testing.assert_close(out, torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("first_col", [0, 1])
def test_token_stats_equal_the_aligned_log_softmax(temperature, first_col):
    # P = 3 left-padded prompts, R = 3 right-padded responses; input_ids = prompt + response
    ids = torch.tensor([[0, 5, 6, 7, 0, 0], [4, 5, 6, 8, 9, 1], [0, 0, 3, 2, 2, 0]])
    mask = (ids != 0).long()
    mask[1, 5] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = pack_rows(ids, mask, pos, 3)
    responses = ids[:, 3:]
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, packed.input_ids.shape[1] - first_col, 10, generator=gen, requires_grad=True)
    ref_lp, ref_ent = _reference(logits, packed, first_col, responses, temperature)
    out = _token_stats(logits, packed, first_col, responses, temperature, calculate_entropy=True)
    assert torch.allclose(out["log_probs"], ref_lp, atol=1e-6)
    assert torch.allclose(out["entropy"], ref_ent, atol=1e-5)
    (grad_fused,) = torch.autograd.grad(out["log_probs"].sum(), logits)
    (grad_ref,) = torch.autograd.grad(ref_lp.sum(), logits)
    assert torch.allclose(grad_fused, grad_ref, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(7, 5), (7, 16), (7, 1037), (7, 49152), (1050, 1024)])
def test_fp32_entropy_kernel_matches_float64_entropy_and_keeps_the_log_probs(rows, vocab):
    """One pass gives the log-probs the log-prob kernel gives (the same floats) and the entropy
    within twice torch's own fp32 error against float64, a vocabulary shorter than a vector and one
    not a multiple of 16 included."""
    gen = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(2, rows, vocab, generator=gen) * 5
    logits[0, 0] = 0.0  # a uniform row: the entropy is log(vocab)
    targets = torch.randint(0, vocab, (2, rows), generator=gen)
    log_probs, entropy = cpu_attention.token_logprob_entropy(logits, targets)
    assert torch.equal(log_probs, cpu_attention.token_logprob(logits, targets)[0])
    assert entropy.shape == targets.shape and entropy.dtype == torch.float32
    exact = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    plain = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert float((entropy.double() - exact).abs().max()) <= 2 * float((plain.double() - exact).abs().max()) + 1e-6
    assert abs(float(entropy[0, 0]) - math.log(vocab)) <= 1e-5 * max(1.0, math.log(vocab))


@needs_kernels
def test_token_stats_take_the_one_pass_entropy_kernel_only_without_a_graph(monkeypatch):
    """The old log-probs' forward (no_grad) reads the logits once for both outputs; with a graph
    (an entropy bonus in the loss) the entropy stays torch's, which autograd differentiates."""
    ids = torch.tensor([[0, 5, 6, 7, 3, 0], [4, 5, 6, 8, 9, 1]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = pack_rows(ids, mask, pos, 3)
    responses = ids[:, 3:]
    logits = torch.randn(2, packed.input_ids.shape[1], 40, generator=torch.Generator().manual_seed(2))
    calls = []
    fused = cpu_attention.token_logprob_entropy
    monkeypatch.setattr(cpu_attention, "token_logprob_entropy", lambda *a: calls.append(1) or fused(*a))
    ref_lp, ref_ent = _reference(logits, packed, 0, responses, 0.7)
    with torch.no_grad():
        out = _token_stats(logits, packed, 0, responses, 0.7, calculate_entropy=True)
    assert calls == [1]
    torch.testing.assert_close(out["log_probs"], ref_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["entropy"], ref_ent, rtol=0, atol=1e-5)
    leaf = logits.clone().requires_grad_()
    out = _token_stats(leaf, packed, 0, responses, 0.7, calculate_entropy=True)
    assert calls == [1] and out["entropy"].requires_grad
    (grad,) = torch.autograd.grad(out["entropy"].sum(), leaf)
    (want,) = torch.autograd.grad(_reference(leaf, packed, 0, responses, 0.7)[1].sum(), leaf)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)

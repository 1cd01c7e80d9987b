"""verl's use_fused_kernels: log-probs and entropy from the hidden states, a chunk of logits at a time."""

import pytest
import torch
import torch.nn.functional as F

from hybridrl.engine import TrainEngine, cpu_attention, fused_head
from hybridrl.engine.train_engine import _entropy

from .helpers import build_model, make_batch, make_group_batch, params_of, reference_outputs

needs_kernels = pytest.mark.skipif(not cpu_attention.available(), reason="hybridrl's CPU kernels do not build here")


def _plain(hidden, weight, bias, targets, temperature):
    """The definition: the whole logits, log_softmax, gather; entropy -sum(p log p)."""
    logits = F.linear(hidden, weight, bias).float() / temperature
    log_p = torch.log_softmax(logits, -1)
    return log_p.gather(-1, targets[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _values_and_grads(fn, hidden, weight, bias, targets, weights):
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    log_probs, entropy = fn(*leaves, targets)
    (log_probs * weights[0] + entropy * weights[1]).sum().backward()
    return [log_probs.detach(), entropy.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize(("dtype", "vocab", "chunk_elements"), [
    (torch.float64, 37, 37 * 5),  # torch's softmax path, many chunks, the last one short
    pytest.param(torch.float32, 1037, 1 << 14, marks=needs_kernels),  # hybridrl's kernels
    (torch.float32, 300, 1 << 24),  # one chunk
])
def test_values_and_gradients_equal_the_full_logits(dtype, vocab, chunk_elements, monkeypatch):
    monkeypatch.setattr(fused_head, "CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(2, 61, 24, generator=gen, dtype=dtype)
    weight = torch.randn(vocab, 24, generator=gen, dtype=dtype) / 2
    bias = torch.randn(vocab, generator=gen, dtype=dtype)
    targets = torch.randint(0, vocab, (2, 61), generator=gen)
    weights = torch.randn(2, 2, 61, generator=gen)
    fused = _values_and_grads(lambda h, w, b, t: fused_head.head_log_probs(h, w, b, t, 0.7, with_entropy=True),
                              hidden, weight, bias, targets, weights)
    plain = _values_and_grads(lambda h, w, b, t: _plain(h, w, b, t, 0.7), hidden, weight, bias, targets, weights)
    for name, got, want in zip(("log_probs", "entropy", "hidden", "weight", "bias"), fused, plain):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_log_probs_alone_keep_no_entropy_and_bf16_weights_get_bf16_gradients():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 16, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(50, 16, generator=gen) / 4).bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (5,), generator=gen)
    log_probs, entropy = fused_head.head_log_probs(hidden, weight, None, targets)
    assert entropy is None and log_probs.dtype == torch.float32
    log_probs.sum().backward()
    want = _plain(hidden.detach().float(), weight.detach().float(), None, targets, 1.0)[0]
    torch.testing.assert_close(log_probs.detach(), want, rtol=0, atol=0.05)
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_bad_arguments_are_named():
    hidden, weight = torch.randn(3, 4), torch.randn(9, 4)
    with pytest.raises(ValueError, match="temperature must be a positive number, got 0"):
        fused_head.head_log_probs(hidden, weight, None, torch.zeros(3, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match=r"hidden states \(3, 4\) do not match targets \(2,\)"):
        fused_head.head_log_probs(hidden, weight, None, torch.zeros(2, dtype=torch.long))


def _largest_saved(engine: TrainEngine, data, loss_fn) -> int:
    """The most elements of any one tensor autograd keeps for the backward during a train step."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.train_step(data, loss_fn, temperature=0.7, calculate_entropy=True)
    return max(sizes)


def _entropy_loss(global_tokens: int):
    """A policy-gradient loss with an entropy bonus, so the entropy has a graph."""
    def loss_fn(outputs, micro):
        mask = micro.batch["response_mask"].float()
        pg = -(outputs["log_probs"] * micro.batch["advantages"] * mask).sum()
        loss = (pg - 0.01 * (outputs["entropy"] * mask).sum()) / global_tokens
        return loss, {"pg_loss": pg.item()}

    return loss_fn


@pytest.mark.parametrize("grouped", [False, True])
def test_engine_steps_equal_the_usual_path_and_keep_no_logits(grouped):
    """A train step with an entropy bonus (and shared prompts for GRPO-style groups): the same loss,
    gradient norm and parameters as without fusion, while no tensor kept for the backward is as
    large as half the logits (the vocabulary is 16x the hidden size, 4x the MLP's gate and up)."""
    data = make_group_batch(prompts=3, group=4, seed=3) if grouped else make_batch(batch_size=8, seed=3)
    loss_fn = _entropy_loss(int(data.batch["response_mask"].sum()))
    vocab = 512
    kwargs = {"vocab_size": vocab}
    usual = TrainEngine(build_model(**kwargs), lr=1e-3, grad_clip=0.5)
    fused = TrainEngine(build_model(**kwargs), lr=1e-3, grad_clip=0.5, fused_log_probs=True)
    want = usual.forward(data, temperature=0.7, calculate_entropy=True)
    got = fused.forward(data, temperature=0.7, calculate_entropy=True)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got.batch[key], want.batch[key], rtol=0, atol=2e-6)
    assert got.meta_info["computed_tokens"] == want.meta_info["computed_tokens"]
    saved_usual = _largest_saved(usual, data, loss_fn)
    saved_fused = _largest_saved(fused, data, loss_fn)
    computed = want.meta_info["computed_tokens"]
    assert saved_usual >= vocab * computed // 2  # the usual path keeps the logits' exponentials
    assert saved_fused < vocab * computed // 2  # the fused path: the MLPs' activations are its largest
    for _ in range(2):
        m_usual, m_fused = (engine.train_step(data, loss_fn, temperature=0.7, calculate_entropy=True)
                            for engine in (usual, fused))
        assert m_fused["loss"] == pytest.approx(m_usual["loss"], rel=1e-5)
        assert m_fused["grad_norm"] == pytest.approx(m_usual["grad_norm"], rel=1e-5)
    fused_params = params_of(fused.model)
    for name, value in params_of(usual.model).items():
        torch.testing.assert_close(fused_params[name], value, rtol=0, atol=1e-5, msg=name)


def test_forward_equals_the_padded_definition_at_a_temperature():
    model = build_model()
    data = make_batch(batch_size=6, seed=4)
    out = TrainEngine(model, lr=0.0, fused_log_probs=True).forward(data, temperature=0.6, calculate_entropy=True)
    want = reference_outputs(model, data, temperature=0.6)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(out.batch[key], want[key], rtol=0, atol=2e-5)


def test_the_lm_head_is_restored_after_each_call():
    engine = TrainEngine(build_model(), lr=1e-3, fused_log_probs=True)
    head = engine.model.get_output_embeddings()
    engine.forward(make_batch(batch_size=4, seed=5))
    assert "forward" not in vars(head)
    hidden = torch.randn(2, 3, head.in_features)
    assert engine.model.get_output_embeddings()(hidden).shape == (2, 3, head.out_features)


def test_unsupported_models_warn_and_take_the_full_logits():
    model = build_model()
    model.config.model_type = "gemma2"  # soft-capped logits: the head's output is not the logits
    with pytest.warns(UserWarning, match="use_fused_kernels: .* not 'gemma2'; its log-probs are computed from the full logits"):
        engine = TrainEngine(model, lr=0.0, fused_log_probs=True)
    assert not engine._fused


@pytest.mark.parametrize(("chunking", "checkpointing"), [(True, False), (False, True), (True, True)])
def test_entropy_chunking_and_checkpointing_give_the_same_values_and_gradients(chunking, checkpointing, monkeypatch):
    """verl's entropy_from_logits_with_chunking / entropy_checkpointing: the same entropy and logits
    gradient; chunking computes 7 positions at a time; checkpointing keeps no softmax for the
    backward (plain: two logits-sized tensors) and computes each part again there."""
    from hybridrl.engine import train_engine

    monkeypatch.setattr(train_engine, "ENTROPY_CHUNK_ROWS", 7)
    entropy_of, parts = train_engine._entropy_of, []
    monkeypatch.setattr(train_engine, "_entropy_of", lambda x: parts.append(x.numel() // x.shape[-1]) or entropy_of(x))
    logits = torch.randn(3, 10, 33, generator=torch.Generator().manual_seed(2)) * 3
    weights = torch.randn(3, 10)
    results = []
    for options in ((False, False), (chunking, checkpointing)):
        leaf = logits.clone().requires_grad_()
        saved = set()
        parts.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.add((t.data_ptr(), t.numel())) or t,
                                                      lambda t: t):
            entropy = _entropy(leaf, *options)
        (entropy * weights).sum().backward()
        start, end = leaf.data_ptr(), leaf.data_ptr() + leaf.numel() * leaf.element_size()
        only_logits = all(start <= ptr < end for ptr, _ in saved)  # views of the input, no softmax
        results.append((entropy.detach(), leaf.grad, saved, list(parts), only_logits))
    (want, want_grad, plain_saved, plain_parts, _), (got, got_grad, _, got_parts, only_logits) = results
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    assert plain_parts == [30] and sum(n == logits.numel() for _, n in plain_saved) == 2
    forward = [7, 7, 7, 7, 2] if chunking else [30]
    # checkpointing: each part again in the backward (which runs them last first)
    assert got_parts == (forward + forward[::-1] if checkpointing else forward)
    assert only_logits == checkpointing

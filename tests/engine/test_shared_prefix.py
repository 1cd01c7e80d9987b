"""Prompts computed once per group (hybridrl.engine.shared_prefix) give the full rows' numbers."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hybridrl.engine import TrainEngine, shared_prefix
from hybridrl.engine.packing import real_lengths
from hybridrl.engine.shared_prefix import prompt_groups, shared_prompt_logits
from hybridrl.models import build_tiny_model

from .helpers import (
    PAD_ID,
    build_model,
    make_batch,
    make_group_batch,
    pg_loss_fn,
    reference_outputs,
    shared_computed,
)

pytestmark = pytest.mark.component


@pytest.fixture(autouse=True)
def one_micro_batch_as_asked(monkeypatch):
    """These tests count the positions of one shared-prompt micro-batch: not cut for padding
    (``HYBRIDRL_PADDING_SPLIT``; ``test_mixed_lengths_are_cut_only_where_that_beats_sharing`` cuts)."""
    monkeypatch.setenv("HYBRIDRL_PADDING_SPLIT", "0")


def build_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


BUILDERS = {"qwen2": build_model, "llama": build_llama}


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("mode", [{}, {"micro_batch_size": 6}, {"max_token_len": 90}], ids=["whole", "rows6", "tokens90"])
def test_forward_with_shared_prompts_matches_the_padded_definition(arch, mode):
    model = BUILDERS[arch]()
    data = make_group_batch(prompts=3, group=4, seed=1)
    ref = reference_outputs(model, data, temperature=0.7)
    out = TrainEngine(model, lr=1e-3).forward(data, temperature=0.7, calculate_entropy=True, **mode)
    torch.testing.assert_close(out.batch["log_probs"], ref["log_probs"], rtol=0, atol=5e-6)
    torch.testing.assert_close(out.batch["entropy"], ref["entropy"], rtol=0, atol=5e-6)
    assert out.meta_info["real_tokens"] == int(data.batch["attention_mask"].sum())


def test_each_prompt_is_computed_once():
    data = make_group_batch(prompts=3, group=4, seed=2)
    shared = TrainEngine(build_model(), lr=1e-3).forward(data).meta_info
    full = TrainEngine(build_model(), lr=1e-3, share_prompts=False).forward(data).meta_info
    assert shared["computed_tokens"] == shared_computed(data) < full["computed_tokens"]
    assert full["needed_tokens"] == full["real_tokens"] == shared["real_tokens"]
    # needed without padding: each group's prompt once (4 rows a group), every response token but the last
    mask, response_len = data.batch["attention_mask"], data.batch["responses"].shape[1]
    prompts = mask[::4, :-response_len].sum()
    responses = (mask[:, -response_len:].sum(1) - 1).sum()
    assert shared["needed_tokens"] == int(prompts + responses) < shared["computed_tokens"]


def test_the_lm_head_runs_once_on_every_rows_positions_and_is_restored(monkeypatch):
    """One head product per micro-batch (pass 2, each row's prompt position first), none in pass 1;
    the head's own forward is back afterwards, also when the forward fails."""
    model = build_model()
    data = make_group_batch(prompts=3, group=4, seed=2)
    engine = TrainEngine(model, lr=1e-3)
    head, calls = model.get_output_embeddings(), []
    product = type(head).forward  # the class's: what the head computes with

    def counted(self, x):
        out = product(self, x)
        if self is head:
            calls.append((tuple(x.shape), tuple(out.shape)))
        return out

    monkeypatch.setattr(type(head), "forward", counted)
    out = engine.forward(data, temperature=0.7)
    response_len = data.batch["responses"].shape[1]
    rows, width = len(data), int(real_lengths(data.batch["attention_mask"], response_len)[1].max())
    assert calls == [((rows, width, model.config.hidden_size), (rows, width, model.config.vocab_size))]
    assert out.batch["log_probs"].shape == (rows, response_len)
    assert "forward" not in vars(head)

    def fail(*args, **kwargs):
        raise RuntimeError("layer failed")

    layer = model.model.layers[0]
    layer.forward = fail
    with pytest.raises(RuntimeError, match="layer failed"):
        TrainEngine(model, lr=1e-3).forward(data)
    assert "forward" not in vars(head) and shared_prefix._active is None


def test_a_one_token_prompt_beside_longer_ones():
    # one group's prompt is a single token beside prompts of 12: its prompt-pass row is padding but for the last column
    data = make_group_batch(prompts=3, group=4, seed=1)
    b = data.batch
    prompt_len = b["input_ids"].shape[1] - b["responses"].shape[1]
    b["attention_mask"][4:8, : prompt_len - 1] = 0
    b["input_ids"][4:8, : prompt_len - 1] = PAD_ID
    b["position_ids"] = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    model = build_model()
    ref = reference_outputs(model, data, temperature=1.0)
    out = TrainEngine(model, lr=1e-3).forward(data, calculate_entropy=True)
    assert out.meta_info["computed_tokens"] == shared_computed(data)  # shared, not the full rows
    torch.testing.assert_close(out.batch["log_probs"], ref["log_probs"], rtol=0, atol=5e-6)
    torch.testing.assert_close(out.batch["entropy"], ref["entropy"], rtol=0, atol=5e-6)


def _tiny_with_kernels():
    """The tiny preset (head size 32): its shared-prompt attention runs in hybridrl's CPU kernels."""
    torch.manual_seed(0)
    return build_tiny_model("tiny")


@pytest.mark.parametrize(("builder", "response_len"), [(build_model, 10), (_tiny_with_kernels, 20)],
                         ids=["sdpa", "kernels-long-responses"])
def test_gradients_through_the_shared_prompt_equal_the_full_rows(builder, response_len):
    """Autograd sums the gradients of a group's rows into its one prompt computation; also with
    responses longer than the prompts and attention in the CPU kernels (where they are built)."""
    data = make_group_batch(prompts=2, group=3, response_len=response_len, seed=3)
    b = data.batch
    response_len = b["responses"].shape[1]
    p, r = real_lengths(b["attention_mask"], response_len)
    assert int(r.max()) - 1 > int(p.max()) or response_len == 10
    weights = torch.randn(b["responses"].shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for shared in (False, True):
        model = builder()
        if shared:
            groups = prompt_groups(b["input_ids"], b["attention_mask"], b["position_ids"],
                                   b["input_ids"].shape[1] - response_len, p, r)
            assert groups is not None and len(groups[0]) == 2
            logits, _ = shared_prompt_logits(model, b["input_ids"], b["attention_mask"], b["position_ids"],
                                             response_len, p, r, groups)
            logits = torch.nn.functional.pad(logits, (0, 0, 0, response_len - logits.shape[1]))
        else:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                           position_ids=b["position_ids"]).logits[:, -response_len - 1 : -1]
        token_lp = torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None]).squeeze(-1)
        (token_lp * weights * b["response_mask"]).sum().backward()
        grads.append({n: q.grad.clone() for n, q in model.named_parameters()})
    for name, want in grads[0].items():
        # float rounding of sums in another order: at most 1e-6 of the largest gradient (the tiny preset's reach ~10)
        torch.testing.assert_close(grads[1][name], want, rtol=1e-5, atol=1e-6 * max(1.0, float(want.abs().max())),
                                   msg=name)


def test_train_step_with_shared_prompts_matches_full_rows():
    data = make_group_batch(prompts=3, group=4, seed=4)
    tokens = int(data.batch["response_mask"].sum())
    metrics, params = [], []
    for share in (False, True):
        engine = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, share_prompts=share)
        metrics.append(engine.train_step(data, pg_loss_fn(tokens), calculate_entropy=True))
        params.append({n: q.detach().clone() for n, q in engine.model.named_parameters()})
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5)
    assert metrics[1]["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-5)
    assert metrics[1]["compute_ratio"] < 1 < metrics[0]["compute_ratio"]  # fewer positions than real tokens
    assert metrics[0]["compute_ratio"] == metrics[0]["padding_ratio"]  # full rows need every real token
    assert metrics[1]["padding_ratio"] >= 1  # padding alone, each prompt counted once
    for name, want in params[0].items():  # AdamW's sqrt(v) amplifies rounding of tiny gradients: atol 1e-5
        torch.testing.assert_close(params[1][name], want, rtol=0, atol=1e-5)


def test_sharing_is_skipped_where_it_does_not_apply(monkeypatch):
    calls = []
    real = shared_prefix.shared_prompt_logits
    monkeypatch.setattr("hybridrl.engine.train_engine.shared_prompt_logits",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    grouped = make_group_batch(prompts=3, group=4, seed=5)
    TrainEngine(build_model(), lr=1e-3).forward(grouped)
    assert calls == [1]
    cases = {
        "switched off": (TrainEngine(build_model(), lr=1e-3, share_prompts=False), grouped),
        "distinct prompts": (TrainEngine(build_model(), lr=1e-3), make_batch(batch_size=8, seed=5)),
        "eager attention": (TrainEngine(build_model(attn_implementation="eager"), lr=1e-3), grouped),
        "activation checkpointing": (TrainEngine(build_model(), lr=1e-3, gradient_checkpointing=True), grouped),
        "sliding window": (TrainEngine(build_model(use_sliding_window=True, sliding_window=4), lr=1e-3), grouped),
    }
    for name, (engine, data) in cases.items():
        out = engine.forward(data)
        assert calls == [1], name
        assert out.meta_info["computed_tokens"] >= out.meta_info["real_tokens"], name


def test_compiled_blocks_share_prompts_with_the_eager_numbers():
    data = make_group_batch(prompts=2, group=4, seed=6)
    tokens = int(data.batch["response_mask"].sum())
    results = []
    for compiled in (False, True):
        engine = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, torch_compile=compiled)
        out = engine.forward(data, calculate_entropy=True)
        results.append((out, engine.train_step(data, pg_loss_fn(tokens))))
    (eager_out, eager_step), (compiled_out, compiled_step) = results
    assert compiled_out.meta_info["computed_tokens"] == eager_out.meta_info["computed_tokens"] == shared_computed(data)
    torch.testing.assert_close(compiled_out.batch["log_probs"], eager_out.batch["log_probs"], rtol=0, atol=5e-6)
    assert compiled_step["grad_norm"] == pytest.approx(eager_step["grad_norm"], rel=1e-5)


def test_mixed_lengths_are_cut_only_where_that_beats_sharing(monkeypatch):
    """With shared prompts a cut for padding is judged by the positions the shared forward computes:
    short prompts and very mixed responses are cut, long prompts shared by the group are kept whole;
    the log-probs are the same either way."""
    monkeypatch.setenv("HYBRIDRL_PADDING_SPLIT", "1")
    short = make_group_batch(prompts=4, group=4, prompt_len=4, response_len=96, seed=3)
    long_prompts = make_group_batch(prompts=1, group=8, prompt_len=96, response_len=12, seed=3)
    for data, cut in ((short, True), (long_prompts, False)):
        model = build_model(max_position_embeddings=256)
        ref = reference_outputs(model, data)
        out = TrainEngine(model, lr=1e-3).forward(data)
        torch.testing.assert_close(out.batch["log_probs"], ref["log_probs"], rtol=0, atol=5e-6)
        if cut:
            assert out.meta_info["computed_tokens"] < 0.9 * shared_computed(data)
        else:
            assert out.meta_info["computed_tokens"] == shared_computed(data)

"""TrainEngine at world size 1: forward definition, micro-batch invariance, checkpoint, export."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.engine import TrainEngine
from hybridrl.engine.cpu_layers import use_cpu_layers
from hybridrl.protocol import DataProto

from .helpers import (
    TinyCritic,
    build_model,
    make_batch,
    params_of,
    pg_loss_fn,
    reference_outputs,
    value_loss_fn,
)

pytestmark = pytest.mark.component

MODES = [{}, {"micro_batch_size": 3}, {"max_token_len": 40}]


@pytest.mark.parametrize("mode", MODES, ids=["whole", "rows3", "tokens40"])
def test_forward_matches_padded_definition(mode):
    model = build_model()
    data = make_batch(batch_size=9)
    ref = reference_outputs(model, data, temperature=0.7)
    engine = TrainEngine(model, lr=1e-3)
    out = engine.forward(data, temperature=0.7, calculate_entropy=True, **mode)
    torch.testing.assert_close(out.batch["log_probs"], ref["log_probs"], rtol=0, atol=2e-6)
    torch.testing.assert_close(out.batch["entropy"], ref["entropy"], rtol=0, atol=2e-6)
    real = int(data.batch["attention_mask"].sum())
    assert out.meta_info["real_tokens"] == real
    assert real <= out.meta_info["computed_tokens"] <= data.batch["input_ids"].numel()


def test_forward_with_a_masked_token_inside_a_response_keeps_the_mask():
    # a zero inside a span (a masked tool token) is a key no later token may see: the engine must
    # keep the mask there, while unbroken rows drop it (causal attention alone is exact for them)
    model = build_model()
    data = make_batch(batch_size=6, seed=4)
    mask = data.batch["attention_mask"]
    row = int(torch.nonzero(mask[:, -10:].sum(1) >= 4)[0])
    mask[row, -10 + 1] = 0
    data.batch["response_mask"][row, 1] = 0
    ref = reference_outputs(model, data)
    out = TrainEngine(model, lr=1e-3).forward(data)
    keys = mask[:, -10:]  # the masked token's own log-prob is not part of the definition
    torch.testing.assert_close(out.batch["log_probs"] * keys, ref["log_probs"], rtol=0, atol=2e-6)


def test_train_step_is_invariant_to_micro_batching():
    data = make_batch(batch_size=10, seed=3)
    tokens = int(data.batch["response_mask"].sum())
    results = []
    for mode in MODES:
        engine = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5)
        metrics = engine.train_step(data, pg_loss_fn(tokens), **mode)
        results.append((metrics, params_of(engine.model)))
    (m0, p0), rest = results[0], results[1:]
    assert m0["grad_norm"] > 0.5  # clipping active, so the clip path is compared too
    for metrics, params in rest:
        assert metrics["loss"] == pytest.approx(m0["loss"], rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
        for name in p0:
            torch.testing.assert_close(params[name], p0[name], rtol=0, atol=1e-6)
    assert results[1][0]["num_micro_batches"] == 4
    start = params_of(build_model())
    assert any(not torch.equal(start[n], p0[n]) for n in p0)


def test_critic_values_and_update():
    data = make_batch(batch_size=6, seed=4)
    model = TinyCritic()
    b = data.batch
    with torch.no_grad():
        full = model(b["input_ids"], b["attention_mask"], b["position_ids"])
    expected = full[:, -11:-1] * b["attention_mask"][:, -10:]
    engine = TrainEngine(model, lr=1e-3, model_type="value")
    out = engine.forward(data, max_token_len=30)
    torch.testing.assert_close(out.batch["values"], expected, rtol=0, atol=2e-6)
    tokens = int(b["response_mask"].sum())
    m1 = engine.train_step(data, value_loss_fn(tokens), micro_batch_size=2)
    assert m1["vf_loss"] > 0 and m1["grad_norm"] > 0
    assert not torch.equal(engine.forward(data).batch["values"], out.batch["values"])


def _run_steps(engine, batches, tokens):
    return [engine.train_step(b, pg_loss_fn(tokens), max_token_len=40) for b in batches]


def test_checkpoint_resume_is_bit_identical(tmp_path):
    # dropout makes the next step depend on the restored RNG state, not only on the weights
    kw = dict(lr=1e-2, lr_scheduler="cosine", warmup_steps=1, total_steps=4, min_lr_ratio=0.1)
    batches = [make_batch(batch_size=8, seed=s) for s in (10, 11, 12)]
    tokens = 40
    torch.manual_seed(7)
    straight = TrainEngine(build_model(attention_dropout=0.2), **kw)
    expected = _run_steps(straight, batches, tokens)

    torch.manual_seed(7)
    first = TrainEngine(build_model(attention_dropout=0.2), **kw)
    _run_steps(first, batches[:1], tokens)
    first.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(12345)
    resumed = TrainEngine(build_model(seed=99, attention_dropout=0.2), **kw)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.global_step == 1
    got = _run_steps(resumed, batches[1:], tokens)
    for a, b in zip(got, expected[1:]):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    final, ref = params_of(resumed.model), params_of(straight.model)
    assert all(torch.equal(final[n], ref[n]) for n in ref)
    assert resumed.optimizer.state_dict()["state"].keys() == straight.optimizer.state_dict()["state"].keys()


@pytest.mark.parametrize("tie", [True, False])
def test_export_hf_reloads_with_same_logits(tmp_path, tie):
    engine = TrainEngine(build_model(tie_word_embeddings=tie), lr=1e-2)
    data = make_batch(batch_size=4, seed=5)
    engine.train_step(data, pg_loss_fn(20))
    engine.export_hf(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    use_cpu_layers(reloaded)  # the engine's MLPs and norms run hybridrl's kernels: the same floats
    b = data.batch
    with torch.no_grad():
        want = engine.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        got = reloaded(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert torch.equal(got, want)
    names = [n for n, _ in engine.iter_full_params()]
    assert ("lm_head.weight" in names) == (not tie)


def test_padding_efficiency_on_mixed_lengths(monkeypatch):
    data = make_batch(batch_size=64, prompt_len=48, response_len=96, seed=6)
    engine = TrainEngine(build_model(max_position_embeddings=256), lr=1e-3)
    real = int(data.batch["attention_mask"].sum())
    padded_ratio = data.batch["input_ids"].numel() / real
    cut = engine.forward(data, micro_batch_size=64)
    dynamic = engine.forward(data, max_token_len=1024).meta_info["computed_tokens"] / real
    monkeypatch.setenv("HYBRIDRL_PADDING_SPLIT", "0")
    one = engine.forward(data, micro_batch_size=64)
    whole = one.meta_info["computed_tokens"] / real
    cut_ratio = cut.meta_info["computed_tokens"] / real
    print(f"computed/real tokens: padded {padded_ratio:.3f}, packed one micro-batch {whole:.3f}, "
          f"cut for padding {cut_ratio:.3f}, length-bucketed max_token_len=1024 {dynamic:.3f}")
    assert dynamic < whole <= padded_ratio
    # one micro-batch asked for: cut into micro-batches of similar lengths, the same log-probs
    assert cut_ratio < 1.25 < 2 < whole
    torch.testing.assert_close(cut.batch["log_probs"], one.batch["log_probs"], rtol=0, atol=2e-6)


def test_a_train_step_cut_for_padding_gives_the_one_micro_batch_numbers(monkeypatch):
    data = make_batch(batch_size=32, prompt_len=24, response_len=96, seed=6)
    tokens = int(data.batch["response_mask"].sum())
    results = []
    for split in ("1", "0"):
        monkeypatch.setenv("HYBRIDRL_PADDING_SPLIT", split)
        engine = TrainEngine(build_model(max_position_embeddings=256), lr=1e-3, grad_clip=0.5)
        results.append((engine.train_step(data, pg_loss_fn(tokens), micro_batch_size=32), params_of(engine.model)))
    (cut, p_cut), (whole, p_whole) = results
    assert cut["num_micro_batches"] > 1 and whole["num_micro_batches"] == 1
    assert whole["padding_ratio"] > 1.5 and cut["padding_ratio"] < 0.75 * whole["padding_ratio"]
    assert cut["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert cut["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    # AdamW's first step moves each parameter by about lr x sign(gradient): a gradient near its eps
    # moves by a rounding-sensitive fraction of lr (1e-3), hence 1e-5 rather than 1e-6
    for name in p_whole:
        torch.testing.assert_close(p_cut[name], p_whole[name], rtol=0, atol=1e-5)
    monkeypatch.setenv("HYBRIDRL_PADDING_SPLIT", "maybe")
    with pytest.raises(ValueError, match="HYBRIDRL_PADDING_SPLIT='maybe'"):
        engine.train_step(data, pg_loss_fn(tokens), micro_batch_size=32)


def test_input_errors_name_the_problem():
    engine = TrainEngine(build_model(), lr=1e-3)
    data = make_batch(batch_size=2)
    with pytest.raises(KeyError, match="responses"):
        engine.forward(DataProto.from_dict(tensors={k: data.batch[k] for k in ("input_ids", "attention_mask")}))
    with pytest.raises(ValueError, match="not both"):
        engine.forward(data, micro_batch_size=1, max_token_len=100)
    with pytest.raises(ValueError, match="max_token_len=5"):
        engine.forward(data, max_token_len=5)
    with pytest.raises(ValueError, match="model_type"):
        TrainEngine(build_model(), lr=1e-3, model_type="policy")


def test_gradient_checkpointing_and_bf16_autocast():
    data = make_batch(batch_size=6, seed=8)
    plain = TrainEngine(build_model(), lr=1e-3).train_step(data, pg_loss_fn(30), micro_batch_size=3)
    ckpt = TrainEngine(build_model(), lr=1e-3, gradient_checkpointing=True)
    assert ckpt.train_step(data, pg_loss_fn(30), micro_batch_size=3)["grad_norm"] == pytest.approx(
        plain["grad_norm"], rel=1e-6
    )
    bf16 = TrainEngine(build_model(), lr=1e-3, param_dtype="bfloat16")
    metrics = bf16.train_step(data, pg_loss_fn(30), micro_batch_size=3)
    assert metrics["grad_norm"] == pytest.approx(plain["grad_norm"], rel=5e-2)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # master weights stay fp32


@pytest.mark.parametrize("grad_clip", [0.05, 1e6, None], ids=["clipping", "below-the-limit", "no-clip"])
def test_clipping_gives_clip_grad_norms_numbers(grad_clip, monkeypatch):
    # the engine skips clip_grad_norm_'s multiplication by a coefficient of 1; parameters after two
    # steps equal those of torch's clip_grad_norm_ (which always multiplies) bit for bit
    data = make_batch(batch_size=6, seed=5)
    tokens = int(data.batch["response_mask"].sum())
    engine = TrainEngine(build_model(), lr=1e-2, grad_clip=grad_clip)
    multiplied = []
    clip = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: multiplied.append(1) or clip(*a, **k))
    norms = [engine.train_step(data, pg_loss_fn(tokens))["grad_norm"] for _ in range(2)]
    assert len(multiplied) == (2 if grad_clip == 0.05 else 0) and min(norms) > 0.05

    reference = TrainEngine(build_model(), lr=1e-2, grad_clip=grad_clip)

    def torch_clip_and_step():
        norm = float(torch.nn.utils.clip_grad_norm_(reference.model.parameters(), max_norm=reference.grad_clip))
        reference.optimizer.step()
        reference.optimizer.zero_grad(set_to_none=True)
        return norm

    monkeypatch.setattr(reference, "_clip_and_step", torch_clip_and_step)
    assert [reference.train_step(data, pg_loss_fn(tokens))["grad_norm"] for _ in range(2)] == norms
    ours, theirs = params_of(engine.model), params_of(reference.model)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_non_finite_grad_norm_skips_the_step():
    engine = TrainEngine(build_model(), lr=1e-2)
    before = params_of(engine.model)
    data = make_batch(batch_size=4, seed=9)

    def nan_loss(outputs, micro):
        return outputs["log_probs"].sum() * float("nan"), {}

    metrics = engine.train_step(data, nan_loss)
    assert metrics["grad_norm"] != metrics["grad_norm"]  # NaN
    after = params_of(engine.model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_row_without_real_tokens_gives_zeros_not_nan():
    data = make_batch(batch_size=4, seed=1)
    data.batch["attention_mask"][2] = 0
    data.batch["response_mask"][2] = 0
    engine = TrainEngine(build_model(), lr=1e-3)
    out = engine.forward(data, micro_batch_size=2).batch["log_probs"]
    assert torch.equal(out[2], torch.zeros(10)) and torch.isfinite(out).all()
    metrics = engine.train_step(data, pg_loss_fn(20))
    assert metrics["grad_norm"] == metrics["grad_norm"] and metrics["grad_norm"] > 0


def test_torch_compile_gives_the_eager_numbers_with_any_micro_batch_shape():
    # dynamic shapes: micro-batches of other widths and row counts reuse the block graph (one for
    # training, one for no-grad forwards), and activation checkpointing recomputes through it
    import torch._dynamo

    torch._dynamo.reset()
    batches = [make_batch(batch_size=10, seed=s) for s in (3, 4)]
    data = batches[0]
    eager = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, gradient_checkpointing=True)
    compiled = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, gradient_checkpointing=True, torch_compile=True)
    blocks = compiled.model.model.layers
    # the blocks, and the final norm that no block contains
    assert all(getattr(m.forward, "_torchdynamo_orig_callable", None) is not None for m in [*blocks, compiled.model.model.norm])
    for mode in ({"max_token_len": 40}, {"micro_batch_size": 3}):
        want = eager.forward(data, temperature=0.7, calculate_entropy=True, **mode)
        got = compiled.forward(data, temperature=0.7, calculate_entropy=True, **mode)
        torch.testing.assert_close(got.batch["log_probs"], want.batch["log_probs"], rtol=0, atol=1e-5)
        torch.testing.assert_close(got.batch["entropy"], want.batch["entropy"], rtol=0, atol=1e-5)
    for batch, mode in zip(batches, ({"max_token_len": 40}, {"micro_batch_size": 4})):
        tokens = int(batch.batch["response_mask"].sum())
        a = eager.train_step(batch, pg_loss_fn(tokens), **mode)
        b = compiled.train_step(batch, pg_loss_fn(tokens), **mode)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["num_micro_batches"] == a["num_micro_batches"] > 1
    p_eager, p_compiled = params_of(eager.model), params_of(compiled.model)
    for name in p_eager:
        torch.testing.assert_close(p_compiled[name], p_eager[name], rtol=0, atol=1e-5)
    # once warm (graphs for training and for no-grad forwards, and dynamo's own one-row
    # specialisation), new widths and row counts compile nothing more
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > 0
    other = make_batch(batch_size=11, prompt_len=15, response_len=13, seed=5)
    compiled.forward(other, micro_batch_size=5)
    compiled.train_step(other, pg_loss_fn(int(other.batch["response_mask"].sum())), micro_batch_size=4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # fused log-probs (use_fused_kernels) replace the LM head, which no graph contains: the same
    # numbers as the eager engine's first step, and nothing compiled anew
    fused = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, gradient_checkpointing=True, torch_compile=True,
                        fused_log_probs=True)
    first = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, gradient_checkpointing=True)
    want = first.forward(data, temperature=0.7, calculate_entropy=True, max_token_len=40)
    got = fused.forward(data, temperature=0.7, calculate_entropy=True, max_token_len=40)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got.batch[key], want.batch[key], rtol=0, atol=1e-5)
    tokens = int(data.batch["response_mask"].sum())
    a, b = (e.train_step(data, pg_loss_fn(tokens), max_token_len=40) for e in (first, fused))
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_compiled_blocks_do_not_tie_dimensions_that_were_equal_once():
    # a first call whose row count equals its width (16 prompts of 16 tokens) must not make every
    # later shape recompile: without duck shaping the two dimensions keep their own symbols
    import torch._dynamo

    from hybridrl.engine.compile import compile_blocks

    torch._dynamo.reset()
    model = build_model()
    compile_blocks(model, torch.device("cpu"))
    with torch.no_grad():
        model(input_ids=torch.randint(1, 90, (6, 6)))
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model(input_ids=torch.randint(1, 90, (6, 9)))
        model(input_ids=torch.randint(1, 90, (5, 7)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs > 0


def test_a_loaded_models_final_norm_stays_compiled_through_train_and_eval(tmp_path):
    # transformers kernelizes a model from_pretrained loads again at each train() / eval() change,
    # which resets its RMSNorms' forwards to their class's; hybridrl's loaders turn that off, and
    # compile_blocks does too for a model loaded without them
    from hybridrl.engine.compile import compile_blocks
    from hybridrl.models import make_tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model_dir(tmp_path / "tiny"), dtype=torch.float32)
    compile_blocks(model, torch.device("cpu"))
    compiled = model.model.norm.forward
    for mode in (True, False, True):
        model.train(mode)
        assert model.model.norm.forward is compiled, mode


def test_torch_compile_errors_are_clear(monkeypatch):
    from torch import nn

    with pytest.raises(ValueError, match="no transformer blocks"):
        TrainEngine(nn.Sequential(nn.Linear(4, 4)), lr=1e-3, torch_compile=True)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        TrainEngine(build_model(), lr=1e-3, torch_compile=True)
    from hybridrl.engine.compile import compile_blocks

    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        compile_blocks(build_model(), torch.device("cuda"))


def test_a_reward_model_scores_each_row_at_its_last_token():
    """model_type="reward": the model's output at each row's last real token (mixed prompt and
    response lengths, an empty response), placed at the last response token, micro-batched or not."""
    from transformers import AutoModelForTokenClassification

    from .helpers import tiny_config

    torch.manual_seed(3)
    model = AutoModelForTokenClassification.from_config(tiny_config(num_labels=1), dtype=torch.float32).eval()
    data = make_batch(batch_size=6, seed=9)
    data.batch["attention_mask"][2, -data.batch["responses"].shape[1]:] = 0  # no response at all
    b = data.batch
    with torch.no_grad():
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    mask = b["attention_mask"]
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # each row's last real column
    want = out.squeeze(-1)[torch.arange(len(mask)), last]
    r = mask[:, -b["responses"].shape[1]:].sum(-1)
    engine = TrainEngine(model, lr=0.0, model_type="reward")
    for mode in ({}, {"micro_batch_size": 2}):
        scores = engine.forward(data, **mode).batch["rm_scores"]
        assert scores.shape == b["responses"].shape
        torch.testing.assert_close(scores[torch.arange(len(r)), (r - 1).clamp(min=0)], want, rtol=0, atol=1e-5)
        assert int((scores != 0).sum()) == len(r)

"""hybridrl.utils.cpu_matmul: oneDNN products in place of MKL's, same numbers to float rounding."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from hybridrl.utils import cpu_matmul
from hybridrl.utils.cpu_matmul import OneDNNLinear, use_onednn_linears

pytestmark = pytest.mark.skipif(not cpu_matmul.onednn_available(), reason="torch without oneDNN")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """fp32 products summed in another order: relative error around 1e-6 of the largest value."""
    assert a.shape == b.shape
    if b.numel() == 0:
        return
    scale = b.abs().max().clamp(min=1e-6)
    assert float((a - b).detach().abs().max() / scale) < 2e-5


@pytest.fixture(params=["onednn", "mkl"])
def weight_grads(request, monkeypatch):
    """Each test below with the weight gradients on each backend (``weight_grad_backend``)."""
    monkeypatch.setattr(cpu_matmul, "_weight_grad_choice", request.param)
    return request.param


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,out", [((7, 33), 48), ((2, 9, 64), 48), ((3, 1, 128), 48), ((5, 16), 1),
                                       ((0, 16), 8), ((2, 0, 16), 8), ((3, 20000), 5), ((4, 7), 20000),
                                       ((400, 20000), 200), ((400, 200), 20000)])
def test_forward_and_gradients_match_nn_linear(shape, out, bias, weight_grads):
    # a value head's single output, empty batches (the weight gradient sums nothing), and sums
    # longer than LONG_SUM (in the forward of 20000 inputs, in the input gradient of 20000 outputs),
    # which run in chunks where the output is large enough (the last two)
    torch.manual_seed(0)
    ref = nn.Linear(shape[-1], out, bias=bias)
    dnn = copy.deepcopy(ref)
    assert use_onednn_linears(dnn, force=True) == 1 and type(dnn) is OneDNNLinear
    x = torch.randn(*shape)
    x_ref, x_dnn = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_dnn = ref(x_ref), dnn(x_dnn)
    _close(out_dnn, out_ref)
    assert not out_dnn._is_view()  # FSDP2 warns about a module output that is a view
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_dnn.backward(grad)
    _close(x_dnn.grad, x_ref.grad)
    _close(dnn.weight.grad, ref.weight.grad)
    if bias:
        _close(dnn.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("rows", "inner", "out", "plan"), [
    (1100, 300, 20, "transposed grad"),  # many rows of a wide input
    (1100, 40, 96, "transposed x"),  # a narrow input, an output at least twice as wide
    (300, 40, 96, "transposed x"),
    (1100, 40, 64, "transposed grad"),
    (1100, 40, 200, "transposed x"),  # an output at least MKL_WIDE_OUTPUT times as wide: MKL reads x^T too
    (50, 300, 700, "transposed grad"),  # few rows
])
def test_each_weight_gradient_product_matches_float64(rows, inner, out, plan, bias, weight_grads):
    assert cpu_matmul.weight_grad_plan(out, inner) == plan
    gen = torch.Generator().manual_seed(rows + inner + out)
    x, grad, weight = torch.randn(rows, inner, generator=gen), torch.randn(rows, out, generator=gen), torch.empty(out, inner)
    grad_w, grad_b = cpu_matmul._weight_grad_op(grad, x, weight, bias)
    _close(grad_w, (grad.double().t() @ x.double()).float())
    assert grad_w.shape == (out, inner) and grad_w.is_contiguous()
    if bias:
        _close(grad_b, grad.double().sum(0).float())
    else:
        assert grad_b.numel() == 0


@pytest.mark.parametrize("bias", [True, False])
def test_weight_gradients_take_hybridrls_kernel_where_it_applies(bias, monkeypatch):
    """On the oneDNN side, the tiny model's shapes go to ``cpu_attention.weight_grad`` (on an AVX-512
    build) and others to oneDNN's products, the same numbers to float rounding either way."""
    from hybridrl.engine import cpu_attention

    monkeypatch.setattr(cpu_matmul, "_weight_grad_choice", "onednn")
    monkeypatch.setattr(cpu_matmul, "_kernels_choice", "hybridrl")  # where the kernels are kept, not timed here
    calls = []
    real = cpu_attention.weight_grad
    monkeypatch.setattr(cpu_attention, "weight_grad",
                        lambda grad, x, with_bias=False: calls.append(grad.shape) or real(grad, x, with_bias))
    gen = torch.Generator().manual_seed(1)
    for rows, inner, out, native in [(1100, 128, 384, True), (1100, 40, 96, False), (300, 512, 512, False)]:
        x, grad = torch.randn(rows, inner, generator=gen), torch.randn(rows, out, generator=gen)
        calls.clear()
        grad_w, grad_b = cpu_matmul._weight_grad_op(grad, x, torch.empty(out, inner), bias)
        assert bool(calls) == (native and cpu_attention.simd_width() == 512)
        _close(grad_w, (grad.double().t() @ x.double()).float())
        if bias:
            _close(grad_b, grad.double().sum(0).float())


@pytest.mark.parametrize("kernels", ["hybridrl", "onednn"])
def test_training_products_take_hybridrls_kernel_where_it_applies(monkeypatch, kernels):
    """The forward and input-gradient products of ``OneDNNLinear`` go to ``cpu_attention.linear`` at the
    shapes it takes (an AVX-512 build) where ``kernels_backend`` keeps hybridrl's kernels, and to oneDNN
    otherwise, the same numbers to float rounding."""
    from hybridrl.engine import cpu_attention

    monkeypatch.setattr(cpu_matmul, "_kernels_choice", kernels)
    calls = []
    real = cpu_attention.linear
    monkeypatch.setattr(cpu_attention, "linear", lambda x, w, b=None: calls.append(tuple(x.shape)) or real(x, w, b))
    gen = torch.Generator().manual_seed(2)
    for rows, inner, out in [(2048, 128, 256), (100, 128, 256), (2048, 40, 24)]:
        x, weight, bias = (torch.randn(*s, generator=gen) for s in ((rows, inner), (out, inner), (out,)))
        grad = torch.randn(rows, out, generator=gen)
        calls.clear()
        y = cpu_matmul._linear_op(x, weight, bias)
        grad_x = cpu_matmul._input_grad_op(grad, weight)
        fast = rows >= cpu_attention.LINEAR_MIN_ROWS and cpu_attention.simd_width() == 512 and kernels == "hybridrl"
        # the forward (out wide) and the input gradient (inner wide) where their outputs are multiples of 16
        assert calls == [shape for shape, width in (((rows, inner), out), ((rows, out), inner)) if fast and width % 16 == 0]
        _close(y, torch.nn.functional.linear(x.double(), weight.double(), bias.double()).float())
        _close(grad_x, (grad.double() @ weight.double()).float())


@pytest.mark.parametrize("kernels", ["hybridrl", "onednn"])
def test_weight_gradients_take_hybridrls_kernel_where_kept(monkeypatch, kernels):
    """``_weight_grad_op`` on the oneDNN side runs ``cpu_attention.weight_grad`` where it takes the operands
    and ``kernels_backend`` keeps hybridrl's kernels, else the oneDNN plan: the same numbers either way."""
    from hybridrl.engine import cpu_attention

    monkeypatch.setattr(cpu_matmul, "_kernels_choice", kernels)
    monkeypatch.setattr(cpu_matmul, "_weight_grad_choice", "onednn")
    calls = []
    real = cpu_attention.weight_grad
    monkeypatch.setattr(cpu_attention, "weight_grad", lambda g, x, b=False: calls.append(tuple(g.shape)) or real(g, x, b))
    gen = torch.Generator().manual_seed(3)
    grad, x, weight = (torch.randn(*s, generator=gen) for s in ((300, 48), (300, 64), (48, 64)))
    grad_w, grad_b = cpu_matmul._weight_grad_op(grad, x, weight, True)
    assert calls == ([(300, 48)] if cpu_attention.simd_width() == 512 and kernels == "hybridrl" else [])
    _close(grad_w, (grad.double().t() @ x.double()).float())
    _close(grad_b, grad.double().sum(0).float())


def test_kernel_calibration_takes_onednn_only_when_clearly_faster(monkeypatch):
    """The per-machine timing's rule, with the two sides' times given (oneDNN's timed first): oneDNN
    at KERNEL_MIN_SPEEDUP or more faster wins, a smaller lead or a loss keeps hybridrl's kernels, and
    every timed call follows a write over the cache (cold operands, as in an update)."""
    from hybridrl.engine import cpu_attention

    if not cpu_attention.simd_width() == 512:
        assert cpu_matmul._calibrate_kernels() == "hybridrl"  # nothing to choose: no timing
        return
    real_zeros = torch.zeros
    monkeypatch.setattr(cpu_matmul, "_last_level_cache_bytes", lambda: 1 << 20)
    for dnn_s, ours_s, want in ((1.0, 2.0, "onednn"), (1.0, cpu_matmul.KERNEL_MIN_SPEEDUP, "onednn"),
                                (1.0, 1.2, "hybridrl"), (2.0, 1.0, "hybridrl")):
        times, timed, flushes = iter([dnn_s, ours_s] * cpu_matmul.KERNEL_REPS), [], []
        monkeypatch.setattr(cpu_matmul, "_seconds", lambda fn, times=times, timed=timed: (
            timed.append(fn), fn(), next(times))[2])
        monkeypatch.setattr(torch, "zeros", lambda *a, flushes=flushes, **k: flushes.append(real_zeros(*a, **k)) or flushes[-1])
        assert cpu_matmul._calibrate_kernels() == want
        assert len(timed) == 2 * cpu_matmul.KERNEL_REPS and [f.numel() for f in flushes] == [(2 << 20) // 4]
        assert float(flushes[0].min()) == float(flushes[0].max()) == len(timed)  # written before each timed call


def _kernels_in_subprocess(value: str, fail_timing: bool = False) -> subprocess.CompletedProcess:
    code = "from hybridrl.utils import cpu_matmul\n"
    if fail_timing:
        code += "def timed(*a, **k): raise AssertionError('timed a product')\ncpu_matmul._clearly_faster = timed\n"
    code += "print(cpu_matmul.kernels_backend())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, cpu_matmul.KERNELS_ENV: value}, timeout=120)


@pytest.mark.parametrize("value", ["hybridrl", "onednn", "auto", "blas"])
def test_kernels_backend_choice(value):
    """``HYBRIDRL_CPU_MATMUL_KERNELS`` forces the choice without timing; ``auto`` times it (either may
    win, by the machine); another value fails, naming the variable."""
    result = _kernels_in_subprocess(value, fail_timing=value != "auto")
    if value == "blas":
        assert result.returncode != 0 and "HYBRIDRL_CPU_MATMUL_KERNELS='blas'" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == value if value != "auto" else result.stdout.strip() in ("hybridrl", "onednn")


def test_weight_gradient_plans_of_the_benchmark_shapes():
    """The shapes the plans were measured on (cpu_matmul's table): SmolLM2's update, the tiny and the 25M model's."""
    def plan(rows, out, inner):  # the shapes with their row counts; the plan depends on out and inner
        return cpu_matmul.weight_grad_plan(out, inner)

    assert {plan(656, out, inner) for out, inner in [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]} == {
        "transposed grad"}
    assert [plan(8320, out, 128) for out in (128, 64, 384, 1024)] == ["transposed grad"] * 2 + ["transposed x"] * 2
    assert plan(8320, 128, 384) == plan(4144, 512, 1536) == plan(4144, 1536, 512) == "transposed grad"


def test_mkl_weight_gradient_products_of_the_benchmark_shapes():
    """MKL computes x^T grad (transposed back) only for an LM head far wider than a narrow input:
    the tiny model's; not its gate and up projections, nor the 25M model's or SmolLM2's LM heads."""
    reads_x = cpu_matmul.mkl_weight_grad_reads_x
    assert reads_x(1024, 128) and reads_x(1024, 256)
    assert not any(reads_x(out, inner) for out, inner in [(384, 128), (256, 128), (128, 384), (64, 128),
                                                          (1024, 512), (49152, 576), (576, 1536)])


@pytest.mark.parametrize("inner", [16, 512, 513, 1536])
def test_input_gradient_product_matches_float64_on_its_backend(inner, weight_grads):
    # MKL takes the input gradients wider than INPUT_GRAD_MKL_WIDTH only where it took the weight gradients
    wide = inner > cpu_matmul.INPUT_GRAD_MKL_WIDTH
    assert cpu_matmul.input_grad_backend(inner) == ("mkl" if wide and weight_grads == "mkl" else "onednn")
    gen = torch.Generator().manual_seed(inner)
    grad, weight = torch.randn(70, 96, generator=gen), torch.randn(96, inner, generator=gen)
    grad_x = cpu_matmul._input_grad_op(grad, weight)
    _close(grad_x, (grad.double() @ weight.double()).float())
    assert grad_x.shape == (70, inner)


@pytest.mark.parametrize("kernels", ["hybridrl", "onednn"])
@pytest.mark.parametrize("inner", [16, 512, 513, 1536])
def test_forward_product_takes_mkl_where_the_input_gradient_does(inner, weight_grads, kernels, monkeypatch):
    """The forward product of an input wider than INPUT_GRAD_MKL_WIDTH goes to MKL where MKL took the
    weight gradients (MKL's own numbers, bit for bit), except at the shapes hybridrl's kernel takes where
    ``kernels_backend`` keeps it; other inputs keep their product. Float64's numbers to rounding."""
    from hybridrl.engine import cpu_attention

    monkeypatch.setattr(cpu_matmul, "_kernels_choice", kernels)
    assert cpu_matmul.forward_backend(inner) == cpu_matmul.input_grad_backend(inner)
    gen = torch.Generator().manual_seed(inner)
    for rows in (70, cpu_attention.LINEAR_MIN_ROWS):
        x, weight, bias = (torch.randn(*s, generator=gen) for s in ((rows, inner), (96, inner), (96,)))
        y = cpu_matmul._linear_op(x, weight, bias)
        _close(y, torch.nn.functional.linear(x.double(), weight.double(), bias.double()).float())
        if cpu_attention.linear_usable(x, weight) and kernels == "hybridrl":
            expected = cpu_attention.linear(x, weight, bias)
        elif cpu_matmul.forward_backend(inner) == "mkl":
            expected = torch.nn.functional.linear(x, weight, bias)
        else:
            expected = cpu_matmul._onednn(x, weight, bias)
        assert torch.equal(y, expected)


@pytest.mark.parametrize("inner", [64, 600])
def test_strided_views_and_compile(inner, weight_grads):
    """The last position of each sequence (rows with gaps between them) and a compiled caller, with
    an input narrow and wide enough for each input-gradient backend."""
    torch.manual_seed(1)
    ref = nn.Linear(inner, 40)
    dnn = copy.deepcopy(ref)
    use_onednn_linears(dnn, force=True)
    hidden = torch.randn(4, 9, inner)

    def head(module, h):
        return module(h[:, -1]).square().sum()

    compiled = torch.compile(lambda h: head(dnn, h), backend="inductor", fullgraph=True)
    for fn, module in ((lambda h: head(dnn, h), dnn), (compiled, dnn)):
        module.zero_grad()
        ref.zero_grad()
        h_ref, h_dnn = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
        loss_ref, loss_dnn = head(ref, h_ref), fn(h_dnn)
        loss_ref.backward()
        loss_dnn.backward()
        _close(loss_dnn, loss_ref)
        _close(h_dnn.grad, h_ref.grad)
        _close(module.weight.grad, ref.weight.grad)


def test_only_fp32_cpu_linears_are_turned():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Embedding(4, 8))
    assert use_onednn_linears(model, force=True) == 1
    assert type(model[0]) is OneDNNLinear and type(model[1]) is nn.Linear
    # state dict keys and tensors are the module's own
    assert set(model.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight"}


def test_inference_linear_matches_f_linear():
    torch.manual_seed(2)
    x, w, b = torch.randn(5, 3, 32), torch.randn(24, 32), torch.randn(24)
    _close(cpu_matmul.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def _backend_in_subprocess(value: str) -> subprocess.CompletedProcess:
    code = "from hybridrl.utils import cpu_matmul; print(cpu_matmul.backend())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "HYBRIDRL_CPU_MATMUL": value}, timeout=120)


@pytest.mark.parametrize("value", ["mkl", "onednn", "auto"])
def test_backend_choice(value):
    result = _backend_in_subprocess(value)
    assert result.returncode == 0, result.stderr
    chosen = result.stdout.strip()
    assert chosen == value if value != "auto" else chosen in ("mkl", "onednn")


def _weight_grad_backend_in_subprocess(value: str) -> str:
    code = ("import torch; from hybridrl.utils import cpu_matmul; "
            "print(cpu_matmul.backend(), cpu_matmul.weight_grad_backend())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "HYBRIDRL_CPU_MATMUL": value}, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.parametrize("value", ["mkl", "onednn", "auto"])
def test_weight_gradient_backend_choice(value):
    """The variable forces the weight gradients' backend too; ``auto`` keeps MKL's where MKL is the
    backend and otherwise times the two on a gradient (either may win, by the machine)."""
    chosen, weight_grads = _weight_grad_backend_in_subprocess(value)
    if value != "auto":
        assert chosen == weight_grads == value
    else:
        assert weight_grads == "mkl" if chosen == "mkl" else weight_grads in ("mkl", "onednn")


def test_weight_gradient_calibration_takes_mkl_only_when_clearly_faster(monkeypatch):
    """The timing's rule, with the products' times given: MKL at WEIGHT_GRAD_MIN_SPEEDUP or more
    faster wins, a smaller lead keeps oneDNN (a near tie does not flip from one process to the next)."""
    for mkl_s, dnn_s, want in ((1.0, 2.0, "mkl"), (1.0, cpu_matmul.WEIGHT_GRAD_MIN_SPEEDUP, "mkl"),
                               (1.0, 1.2, "onednn"), (2.0, 1.0, "onednn")):
        times = iter([mkl_s, dnn_s] * 3)
        monkeypatch.setattr(cpu_matmul, "_seconds", lambda fn, times=times: (fn(), next(times))[1])
        monkeypatch.setattr(cpu_matmul, "WEIGHT_GRAD_CALIBRATION_SHAPE", (32, 64, 16))
        monkeypatch.setattr(cpu_matmul, "_kernels_choice", "hybridrl")  # no timing of its own here
        assert cpu_matmul._calibrate_weight_grad() == want


def test_bad_backend_names_the_variable():
    result = _backend_in_subprocess("blas")
    assert result.returncode != 0 and "HYBRIDRL_CPU_MATMUL='blas'" in result.stderr


def _choices_in_subprocess(env: dict[str, str]) -> subprocess.CompletedProcess:
    """backend() and weight_grad_backend() in a fresh process under ``env``, with the timings made
    to fail: a pinned choice must not time anything."""
    code = ("from hybridrl.utils import cpu_matmul\n"
            "def timed(*a, **k): raise AssertionError('timed a product')\n"
            "cpu_matmul._faster = timed\n"
            "print(cpu_matmul.backend(), cpu_matmul.weight_grad_backend())")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_pinned_choices_make_another_process_take_the_same_without_timing(monkeypatch):
    """What a CPU worker group exports into its ranks: this process's choices, which a fresh process
    takes as they are, whichever of the four combinations they are."""
    monkeypatch.delenv(cpu_matmul.ENV, raising=False)
    monkeypatch.delenv(cpu_matmul.WEIGHT_GRAD_ENV, raising=False)
    monkeypatch.delenv(cpu_matmul.KERNELS_ENV, raising=False)
    pinned = cpu_matmul.pinned_choices()
    assert pinned == {cpu_matmul.ENV: cpu_matmul.backend(), cpu_matmul.WEIGHT_GRAD_ENV: cpu_matmul.weight_grad_backend(),
                      cpu_matmul.KERNELS_ENV: cpu_matmul.kernels_backend()}
    for kernels in ("hybridrl", "onednn"):
        result = _kernels_in_subprocess(kernels, fail_timing=True)
        assert result.returncode == 0 and result.stdout.strip() == kernels, result.stderr
    for forward in ("mkl", "onednn"):
        for grads in ("mkl", "onednn"):
            result = _choices_in_subprocess({cpu_matmul.ENV: forward, cpu_matmul.WEIGHT_GRAD_ENV: grads})
            assert result.returncode == 0, result.stderr
            assert result.stdout.split() == [forward, grads]
    result = _choices_in_subprocess({cpu_matmul.ENV: "onednn", cpu_matmul.WEIGHT_GRAD_ENV: "blas"})
    assert result.returncode != 0 and "HYBRIDRL_CPU_MATMUL_WEIGHT_GRAD='blas'" in result.stderr


def test_cpu_worker_group_ranks_get_the_drivers_choices(monkeypatch):
    """PPOWorkers hands every rank the driver's pinned choices (the local backend's one rank here;
    Ray ranks get the same env through WorkerHost.setup)."""
    from hybridrl.trainer import workers

    seen = {}

    class Group:
        def __init__(self, pool, roles, backend, name, env):
            seen.update(env)
            self.world_size = 1

    monkeypatch.setattr(workers, "WorkerGroup", Group)
    monkeypatch.setattr(cpu_matmul, "pinned_choices", lambda: {cpu_matmul.ENV: "mkl", cpu_matmul.WEIGHT_GRAD_ENV: "onednn"})
    from hybridrl.config import load_config

    config = load_config(["trainer.backend=local", "trainer.n_cpu_workers=1"], preset="grpo_quickstart")
    workers.PPOWorkers(config, total_training_steps=1)
    assert seen == {cpu_matmul.ENV: "mkl", cpu_matmul.WEIGHT_GRAD_ENV: "onednn"}


def test_train_engine_with_onednn_matches_mkl(monkeypatch):
    """Two engines on the same tiny model and batch, one on each backend: same losses and weights
    after two steps, to float rounding."""
    from hybridrl.engine import TrainEngine
    from hybridrl.models import build_tiny_model
    from hybridrl.protocol import DataProto

    ids = torch.randint(3, 1000, (6, 20), generator=torch.Generator().manual_seed(0))
    data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                        "responses": ids[:, 8:].clone()})
    results = {}
    for choice in ("mkl", "onednn"):
        monkeypatch.setattr(cpu_matmul, "_choice", choice)
        torch.manual_seed(0)
        engine = TrainEngine(build_tiny_model("tiny"), lr=1e-3)
        turned = sum(type(m) is OneDNNLinear for m in engine.model.modules())
        assert (turned > 0) == (choice == "onednn")
        losses = [engine.train_step(data, lambda out, micro: (-out["log_probs"].mean(), {}))["loss"] for _ in range(2)]
        results[choice] = (losses, torch.cat([p.detach().flatten() for p in engine.model.parameters()]))
    assert results["onednn"][0] == pytest.approx(results["mkl"][0], rel=1e-5)
    # AdamW's first steps move each weight by about lr * sign(gradient): where a gradient is near
    # zero, its rounding (another summation order) shows at the scale of lr, not of the weight
    assert float((results["onednn"][1] - results["mkl"][1]).abs().max()) < 0.05 * 1e-3

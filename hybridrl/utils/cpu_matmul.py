"""fp32 matmuls on CPU through oneDNN unless torch's default BLAS (MKL) is clearly faster.

torch runs an fp32 ``mm`` / ``F.linear`` on CPU through MKL's sgemm, which takes its fastest
(AVX-512) code only on Intel processors. On an AMD EPYC with AVX-512 (a Zen 5 here) it runs the AVX2
code at about half the machine's rate: on this project's Zen 5 machines 104-117 GFLOP/s on one
thread, where oneDNN (bundled with torch, dispatching on the instruction set rather than the vendor)
reaches 250-260 GFLOP/s on the same products, including the transposed ones of a backward pass. On a
Zen 4, whose AVX-512 runs on 256-bit units, the lead is smaller: 74-96 against MKL's 64-76 GFLOP/s
on the tiny model's forward products (one thread). On an AVX2 machine (a Zen 3 here) the two tie on
one product (MKL / oneDNN time 0.97-1.24 over eight timings of the calibration product below), and a
whole tiny-model GRPO step ran faster with oneDNN (1.22-1.27 vs 1.36-1.37 s, alternating): the
training products go through hybridrl's ops below and the decoder's kernel takes steps of up to 128
rows. So oneDNN is the default, and MKL is kept only where it is clearly faster (a CPU where it runs
at full rate).

``backend()`` decides once per process (a CPU trainer decides in the driver and hands the choices
to every rank, ``pinned_choices``): ``HYBRIDRL_CPU_MATMUL=onednn`` or ``mkl`` forces one;
``auto`` (the default) times both on one product and takes MKL only when it is at least
``MIN_SPEEDUP`` faster (a threshold on one side: where the two tie, a timing's noise does not flip the
choice from one process to the next). The weight gradients of the training products have a choice of
their own (``weight_grad_backend()``, the same variable, timed on a gradient the first time one is
needed), since where MKL runs at the machine's full rate its products on a transposed operand can
beat oneDNN's by 1.5-2x while the forward products tie or lead by less than ``MIN_SPEEDUP``; where it
took them, it also takes the input gradients of inputs wider than ``INPUT_GRAD_MKL_WIDTH``
(``input_grad_backend``) and the forward products of those inputs that hybridrl's kernel does not
take (``forward_backend``). Where oneDNN is chosen:

- ``use_onednn_linears(model)`` turns a model's fp32 CPU ``nn.Linear`` modules into
  ``OneDNNLinear`` (same parameters, state dict and numbers to float rounding), whose forward runs
  through the custom op ``hybridrl::linear_v<N>`` and whose input and weight gradients run through
  ``hybridrl::linear_input_grad_v<N>`` and ``hybridrl::linear_weight_grad_v<N>`` (each on the backend
  chosen above; on the oneDNN side, on an AVX-512 machine, weight gradients of up to 128 K outputs
  run on hybridrl's own kernel, ``cpu_attention.weight_grad``, which needs no transposed copy, and
  forward and input-gradient products of at least 1024 rows with up to 2 M weights on
  ``cpu_attention.linear``, faster than oneDNN's with their operands cold on a Zen 4; both kernels
  only where ``kernels_backend()``, timed per machine like the rest, keeps them), all opaque to
  ``torch.compile``; the training engine applies it;
- ``linear(x, weight, bias)`` is the inference-only product the rollout's decoder uses for prefill
  and for decode steps too large for its own kernel.

The products differ from MKL's only in summation order (relative differences around 1e-6).
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MIN_SPEEDUP", "OneDNNLinear", "backend", "fp32_cpu", "kernels_backend", "linear", "onednn_available",
           "pinned_choices", "use_onednn_linears", "uses_onednn", "forward_backend", "input_grad_backend",
           "weight_grad_backend"]

BACKENDS = ("auto", "mkl", "onednn")
MIN_SPEEDUP = 1.2  # auto keeps MKL only when it is at least this much faster than oneDNN
CALIBRATION_SHAPE = (256, 512, 1024)  # rows, in, out of the timed product
_choice: str | None = None


def onednn_available() -> bool:
    """Whether this torch has oneDNN's fp32 linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A 2-D operand as oneDNN runs it fast: row-major or its transpose without gaps between rows; a
    view with a larger row stride (e.g. the last position of every sequence) ran a 4-row product
    60x slower than a copy of it."""
    rows, cols = t.shape
    if (t.stride(1) == 1 and t.stride(0) == cols) or (t.stride(0) == 1 and t.stride(1) == rows):
        return t
    return t.contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., k) -> (m, k); a 2-D tensor as it is (also when empty, where reshape(-1, 0) is ambiguous)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


# A sum over more than LONG_SUM products with an output of at least LONG_SUM_MIN_OUTPUT values runs
# as products over chunks of LONG_SUM_CHUNK, added up (each chunk of a row-major x is copied first):
# SmolLM2's LM-head input gradient (512 x 576 outputs, a sum over its 49152 vocabulary entries) took
# 172 ms as one product and 153 in chunks (a (576, 576) weight gradient over 30000 rows read 131 vs
# 105 ms once and 117 vs 118 another time). Small outputs lost to the copies: (128, 128) over 20000
# rows 3.7 vs 4.0 ms, (64, 128) over 40000 4.0 vs 4.9 ms (one thread, best of 5-7).
LONG_SUM = 16384
LONG_SUM_CHUNK = 8192
LONG_SUM_MIN_OUTPUT = 1 << 16


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (m, in) @ weight (out, in)^T + bias through oneDNN; either operand may be a transposed view.
    An empty sum (in = 0, e.g. the weight gradient of an empty batch) has no oneDNN primitive."""
    if x.shape[1] == 0:
        return F.linear(x, weight, bias)
    if x.shape[1] > LONG_SUM and x.shape[0] * weight.shape[0] >= LONG_SUM_MIN_OUTPUT:
        out = None
        for start in range(0, x.shape[1], LONG_SUM_CHUNK):
            cols = slice(start, start + LONG_SUM_CHUNK)
            part = torch.ops.mkldnn._linear_pointwise(_compact(x[:, cols]), _compact(weight[:, cols]), None,
                                                      "none", [], "")
            out = part if out is None else out.add_(part)
        return out if bias is None else out.add_(bias)
    return torch.ops.mkldnn._linear_pointwise(_compact(x), _compact(weight), bias, "none", [], "")


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _clearly_faster(challenger, incumbent, min_speedup: float, reps: int, before=None) -> bool:
    """Whether ``challenger()`` runs at least ``min_speedup`` faster than ``incumbent()``. The two
    alternate and each keeps its best time, so a busy moment of the machine (other ranks starting up
    beside this one) falls on both; ``before()``, where given, runs ahead of each timed call, untimed."""
    def timed(fn) -> float:
        if before is not None:
            before()
        return _seconds(fn)

    challenger(), incumbent()
    challenger_s = incumbent_s = float("inf")
    for _ in range(reps):
        challenger_s = min(challenger_s, timed(challenger))
        incumbent_s = min(incumbent_s, timed(incumbent))
    return challenger_s * min_speedup <= incumbent_s


def _faster(mkl, dnn, min_speedup: float, reps: int) -> str:
    """"mkl" if ``mkl()`` runs at least ``min_speedup`` faster than ``dnn()``, else "onednn"
    (``_clearly_faster``)."""
    return "mkl" if _clearly_faster(mkl, dnn, min_speedup, reps) else "onednn"


def _randn(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def _calibrate(reps: int = 5) -> str:
    """"mkl" if MKL's product is at least MIN_SPEEDUP faster than oneDNN's here, else "onednn"."""
    rows, k, out = CALIBRATION_SHAPE
    x, weight = _randn((rows, k), (out, k))
    return _faster(lambda: F.linear(x, weight), lambda: _onednn(x, weight, None), MIN_SPEEDUP, reps)


ENV = "HYBRIDRL_CPU_MATMUL"
WEIGHT_GRAD_ENV = "HYBRIDRL_CPU_MATMUL_WEIGHT_GRAD"  # the weight gradients' own (``pinned_choices``)


def _requested(name: str = ENV) -> str:
    """The environment variable ``name``: "auto", "mkl" or "onednn" (checked)."""
    wanted = os.environ.get(name, "auto").strip().lower()
    if wanted not in BACKENDS:
        raise ValueError(f"{name}={wanted!r}; allowed: {BACKENDS}")
    if wanted == "onednn" and not onednn_available():
        raise ValueError(f"{name}=onednn but this torch has no oneDNN (torch.backends.mkldnn)")
    return wanted


def backend() -> str:
    """"onednn" or "mkl": the CPU fp32 matmul backend of this process (see the module docstring)."""
    global _choice
    if _choice is None:
        wanted = _requested()
        if wanted == "auto":
            wanted = _calibrate() if onednn_available() else "mkl"
        _choice = wanted
    return _choice


def fp32_cpu(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given (None skipped) is fp32 on CPU."""
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in tensors)


def uses_onednn(*tensors: torch.Tensor | None) -> bool:
    """Whether a product of these operands runs through oneDNN: fp32 CPU tensors where ``backend()``
    chose it (checked in that order, so other devices never time the CPU backends)."""
    return fp32_cpu(*tensors) and backend() == "onednn"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for inference: through oneDNN where ``uses_onednn``."""
    if not uses_onednn(x, weight, bias):
        return F.linear(x, weight, bias)
    return _onednn(_rows(x), weight, bias).view(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------- trainable linear
# Part of the ops' names. AOTAutograd's on-disk cache keys a compiled graph by the ops it calls, not
# by their autograd code: a graph compiled before a change to ``_backward`` would keep the old
# backward. Bump this when the ops or their backward change, so that graphs are compiled anew.
OP_VERSION = 3


# hybridrl's own training products (``cpu_attention.linear`` for forward and input-gradient products,
# ``cpu_attention.weight_grad`` for weight gradients, AVX-512 builds, the shapes their ``*_usable``
# take) were written for and measured on a Zen 4, whose AVX-512 runs on 256-bit units: there they
# beat oneDNN's products with their operands cold, as an update leaves them. A CPU with full-width
# AVX-512 has twice the multiply-add rate per core (a Zen 5 ran oneDNN's products at 250-260 GFLOP/s
# a thread), which simple register tiles may not reach. So the choice is timed per machine
# (``kernels_backend``): both kernels against oneDNN's products at KERNEL_LINEAR_SHAPE and
# KERNEL_WEIGHT_GRAD_SHAPE, each call after a write over twice the last-level cache (an update's
# products read what the op before them left in memory), best of KERNEL_REPS alternating; oneDNN's
# only where it is at least KERNEL_MIN_SPEEDUP faster. On the Zen 4 oneDNN's time over hybridrl's
# for the two products together read 1.05-1.11 on one thread and 1.00-1.12 on two (three processes
# each), well short of the threshold, and a near tie keeps hybridrl's kernels from one process to the
# next (products that round differently would give a resumed run other numbers). It costs about
# 0.23 s once per training process, where the kernels apply; a CPU run times it in the driver and
# pins it for every rank (``pinned_choices``).
KERNELS_ENV = "HYBRIDRL_CPU_MATMUL_KERNELS"
KERNEL_CHOICES = ("auto", "hybridrl", "onednn")
KERNEL_LINEAR_SHAPE = (2048, 512, 512)  # rows, in, out
KERNEL_WEIGHT_GRAD_SHAPE = (4096, 256, 256)  # rows, in, out (at most WEIGHT_GRAD_MAX_OUTPUTS outputs)
KERNEL_MIN_SPEEDUP = 1.25
KERNEL_REPS = 3
_kernels_choice: str | None = None


def _last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache this machine reports (sysfs), else ``default``."""
    sizes = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in os.listdir(root):
            with open(os.path.join(root, index, "size")) as f:
                text = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return max(sizes, default=default)


def _calibrate_kernels(reps: int = KERNEL_REPS) -> str:
    """"onednn" if oneDNN's products run at least KERNEL_MIN_SPEEDUP faster than hybridrl's kernels at
    the calibration shapes with cold operands, else "hybridrl"; "hybridrl" without timing where the
    kernels take no product here (no AVX-512 build, no oneDNN), since then there is nothing to choose."""
    from hybridrl.engine import cpu_attention  # here: hybridrl.engine imports this module

    if not (onednn_available() and cpu_attention.simd_width() == 512):  # before making any operand
        return "hybridrl"
    rows, k, out = KERNEL_LINEAR_SHAPE
    g_rows, g_in, g_out = KERNEL_WEIGHT_GRAD_SHAPE
    x, weight, gx, grad = _randn((rows, k), (out, k), (g_rows, g_in), (g_rows, g_out))
    if not (cpu_attention.linear_usable(x, weight) and cpu_attention.weight_grad_usable(grad, gx)):
        return "hybridrl"
    flush = torch.zeros(min(2 * _last_level_cache_bytes(), 1 << 30) // 4)

    def ours():
        cpu_attention.linear(x, weight)
        cpu_attention.weight_grad(grad, gx)

    def theirs():
        _onednn(x, weight, None)
        _onednn_weight_grad(grad, gx)

    clearly = _clearly_faster(theirs, ours, KERNEL_MIN_SPEEDUP, reps, before=lambda: flush.add_(1.0))
    return "onednn" if clearly else "hybridrl"


def kernels_backend() -> str:
    """"hybridrl" or "onednn": whether the training products that hybridrl's kernels take run on them
    in this process (see above). ``HYBRIDRL_CPU_MATMUL_KERNELS=hybridrl`` or ``onednn`` forces it;
    ``auto`` (the default) times the two once, on first use."""
    global _kernels_choice
    if _kernels_choice is None:
        wanted = os.environ.get(KERNELS_ENV, "auto").strip().lower()
        if wanted not in KERNEL_CHOICES:
            raise ValueError(f"{KERNELS_ENV}={wanted!r}; allowed: {KERNEL_CHOICES}")
        _kernels_choice = _calibrate_kernels() if wanted == "auto" else wanted
    return _kernels_choice


def _training_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      mkl: bool = False) -> torch.Tensor:
    """x (m, in) @ weight (out, in)^T + bias on the oneDNN side of a training product: hybridrl's kernel
    where it applies (``cpu_attention.linear``; the rates in cpu_attention.c) and ``kernels_backend``
    keeps it, else MKL's with ``mkl`` (a forward product ``forward_backend`` gives to MKL), else
    oneDNN's."""
    from hybridrl.engine import cpu_attention  # here: hybridrl.engine imports this module

    if cpu_attention.linear_usable(x, weight) and kernels_backend() == "hybridrl":
        return cpu_attention.linear(x, weight, bias)
    return F.linear(x, weight, bias) if mkl else _onednn(x, weight, bias)


@torch.library.custom_op(f"hybridrl::linear_v{OP_VERSION}", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    mkl = forward_backend(weight.shape[1]) == "mkl"
    out = _training_product(_rows(x), weight, bias, mkl).view(*x.shape[:-1], weight.shape[0])
    # a tensor of its own over the same memory, not a view: FSDP2 warns about (and autograd treats
    # specially) a module output that is a view, and the LM head's output is the model's
    return out.new_empty(0).set_(out.untyped_storage(), out.storage_offset(), out.shape, out.stride())


@_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# How the weight gradient grad^T x of grad (m, out), x (m, in) is computed (``_weight_grad_op``):
# an inner product needs one operand transposed in memory (`cpu_attention.transposed`, a blocked
# register transpose). oneDNN's weight-gradient primitive reads both operands as they are, but copies
# them into its own tensors first (``to_mkldnn``) and its result out again; it led at many rows of a
# wide input until the transposes read ahead and streamed their large outputs (2026-12-02). Best of 9
# on a Zen 5, one thread, GFLOP/s primitive / inner product on the transposed x / on the transposed
# grad: the tiny model's down projection (8288 rows, in 384, out 128) 142-158 / 145-162 / 170-183;
# the 25M model's (4144 rows) q 161 / 174 / 186, k and v 149 / 160 / 175, gate and up 147-162 /
# 158-169 / 165-185, LM head 172 / 186 / 187, down 172-174 / 177-180 / 169-181; SmolLM2's (656 rows)
# 163 / 177 / 199 (down); whole updates alternating in one process, primitive vs transposed grad at
# those shapes: tiny 0.418 -> 0.405 s, 25M 3.89 -> 3.75 s (medians). Earlier, before the faster
# transposes: the tiny model's q 118 / 119 / 140, gate and up (out 384) 97 / 124 / 80, LM head (out
# 1024) 137 / 155 / 115. So: the transposed x when the input is narrow and the output at least
# twice as wide (the smaller copy), else the transposed grad.
WEIGHT_GRAD_NARROW_INPUT = 256

# Where MKL runs at the machine's full rate (a Zen 1 EPYC here: its AVX2 code on 128-bit units, the
# forward products tie with oneDNN's), its sgemm reads a transposed operand in place while oneDNN
# runs slowly on one: grad^T x one by one, one thread, GFLOP/s by the plans above / MKL (``grad.t() @
# x``), best of 7 alternating: the 25M model's down projection (4144 rows, in 1536) 15.7 / 34.6, its
# q 30.4 / 33.9; SmolLM2's down (656 rows) 20.8 / 32.8, its q 26.6 / 32.3; the tiny model's q (8320
# rows) 16.7 / 21.2, its LM head 27.1 / 28.2. A 25M update alternating in one shell: 27.5 -> 23.4 s
# (medians of 4 steps). On a Zen 5 oneDNN leads by 1.5-2x instead, so the choice is timed: MKL for
# the weight gradients only where it is at least WEIGHT_GRAD_MIN_SPEEDUP faster on a down
# projection's gradient of 1024 rows, the shape where the two differ most (1.6-2.0x on the Zen 1 over
# eight processes at one and two threads; 512 rows read 1.3-1.7x, too close to the threshold, and the
# smaller shapes 1.1-1.3x), with a wider margin than the forward's so that a machine near a tie keeps
# oneDNN from one process to the next. The timing costs 0.5-0.9 s once per training process there.
# On an Intel Xeon (AVX-512 on two 512-bit units, where MKL takes its AVX-512 code) the gap grows with
# the rows: oneDNN's time over MKL's 1.21 at 1024 rows, 1.84 at 2048, 2.13 at 4096 (one thread; two
# threads 1.25 / 1.80 / 1.93), and the 25M model's update has 4144 rows. At 1024 rows the timing kept
# oneDNN there, and the update took 4.46 s, against 4.00 with MKL's weight gradients. So 2048 rows,
# where the Zen 1's lead was already clear at 1024. Twice the rows take about twice as long to time:
# on the Xeon 0.22-0.23 s a timing (1.07 s for a process's first, which loads the kernels).
WEIGHT_GRAD_CALIBRATION_SHAPE = (2048, 1536, 512)  # rows, in, out
WEIGHT_GRAD_MIN_SPEEDUP = 1.3
# MKL's grad^T x ran at 29 GFLOP/s on the tiny model's LM head (8192 rows, in 128, out 1024) where
# x^T grad, transposed back (a copy of in x out), ran at 34-37 (Zen 1, one thread; two threads 57 /
# 63); at 1660 rows 29 / 34, the LM head of a 256-wide model 32.6 / 35.4, of a 64-wide one 23 / 30.
# With the output 2-3 times as wide the two tie or grad^T x leads (in 128: out 384 34.5 / 34.5,
# out 256 33.6 / 32.4), and with a wide input the copy costs more than it gains (SmolLM2's LM head,
# in 576, out 49152: 29.8 / 28.5). So x^T grad where the input is narrow and the output at least
# MKL_WIDE_OUTPUT times as wide.
MKL_WIDE_OUTPUT = 4
_weight_grad_choice: str | None = None


def _onednn_weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad^T x through oneDNN, by the product ``weight_grad_plan`` picks for the shape."""
    from hybridrl.engine.cpu_attention import transposed  # here: hybridrl.engine imports this module

    if weight_grad_plan(grad.shape[1], x.shape[1]) == "transposed x":
        # (in, m) @ grad -> (in, out), transposed back (a copy of in x out)
        return transposed(_onednn(transposed(x), grad.t(), None))
    return _onednn(transposed(grad), x.t(), None)  # grad^T (out, m) @ x: the inner product reads x^T in place


def _native_weight_grad(grad: torch.Tensor, x: torch.Tensor,
                        with_bias: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad^T x, and with ``with_bias`` grad summed over rows, else None): by hybridrl's kernel where it
    applies (``cpu_attention.weight_grad``: both operands read in place, no transposed copy, the bias's
    sum from the same pass; the rates in cpu_attention.c) where ``kernels_backend`` keeps it, else
    ``_onednn_weight_grad`` and torch's sum."""
    from hybridrl.engine import cpu_attention

    if cpu_attention.weight_grad_usable(grad, x) and kernels_backend() == "hybridrl":
        return cpu_attention.weight_grad(grad, x, with_bias)
    return _onednn_weight_grad(grad, x), grad.sum(0) if with_bias else None


def _calibrate_weight_grad(reps: int = 3) -> str:
    """"mkl" if MKL's grad^T x is at least WEIGHT_GRAD_MIN_SPEEDUP faster than oneDNN's at the
    calibration shape, else "onednn" (alternating, best of each, as ``_calibrate``)."""
    rows, k, out = WEIGHT_GRAD_CALIBRATION_SHAPE
    x, grad = _randn((rows, k), (rows, out))
    return _faster(lambda: torch.mm(grad.t(), x), lambda: _native_weight_grad(grad, x), WEIGHT_GRAD_MIN_SPEEDUP, reps)


def weight_grad_backend() -> str:
    """"onednn" or "mkl": the product of ``OneDNNLinear``'s weight gradients in this process.
    ``HYBRIDRL_CPU_MATMUL_WEIGHT_GRAD=onednn`` or ``mkl`` forces it, else ``HYBRIDRL_CPU_MATMUL=onednn``
    or ``mkl`` does; ``auto`` keeps MKL's where MKL is the backend, and otherwise times both once, on
    first use (see above)."""
    global _weight_grad_choice
    if _weight_grad_choice is None:
        wanted = _requested(WEIGHT_GRAD_ENV)
        if wanted == "auto":
            wanted = _requested()
        if wanted == "auto":
            wanted = "mkl" if backend() == "mkl" else _calibrate_weight_grad()
        _weight_grad_choice = wanted
    return _weight_grad_choice


def pinned_choices() -> dict[str, str]:
    """This process's choices (``backend()``, ``weight_grad_backend()`` and ``kernels_backend()``, timed
    here where they are "auto") as the environment that makes another process take the same ones
    without timing. A CPU
    worker group exports it into every rank (``hybridrl.trainer.workers``): each rank timing for itself
    could choose differently in a busy moment, and ranks or runs whose products round differently
    no longer give the same numbers (on a Zen 1 the two backends' weight gradients put a two-rank PPO
    run's second-step pg_loss 2e-4 of itself apart, and a CI run whose value matched neither was 3e-4
    off; with the same choices, sharded and replicated runs agreed to 4e-6)."""
    return {ENV: backend(), WEIGHT_GRAD_ENV: weight_grad_backend(), KERNELS_ENV: kernels_backend()}


def weight_grad_plan(out: int, inner: int) -> str:
    """How ``_weight_grad_op`` computes the weight gradient of a linear (inner -> out), whatever its
    row count: "transposed x" or "transposed grad" (the table above)."""
    if inner <= WEIGHT_GRAD_NARROW_INPUT and out >= 2 * inner:  # x^T (in, m) is the smaller copy
        return "transposed x"
    return "transposed grad"


def mkl_weight_grad_reads_x(out: int, inner: int) -> bool:
    """Whether ``_weight_grad_op`` on MKL computes x^T grad and transposes it back rather than
    grad^T x, for a linear (inner -> out), whatever its row count (the measurements above)."""
    return inner <= WEIGHT_GRAD_NARROW_INPUT and out >= MKL_WIDE_OUTPUT * inner


@torch.library.custom_op(f"hybridrl::linear_weight_grad_v{OP_VERSION}", mutates_args=())
def _weight_grad_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    with_bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad^T x, grad summed over rows, or an empty tensor without ``with_bias``) for grad (m, out),
    x (m, in): through MKL where ``weight_grad_backend()`` chose it (``mkl_weight_grad_reads_x`` picks
    the product), else oneDNN's ``weight_grad_plan``."""
    if grad.shape[0] == 0:
        return grad.new_zeros(weight.shape), grad.new_zeros(weight.shape[0] if with_bias else 0)
    if weight_grad_backend() == "mkl":  # MKL's sgemm reads the transposed operand in place
        grad_w = torch.mm(x.t(), grad).t().contiguous() if mkl_weight_grad_reads_x(
            grad.shape[1], x.shape[1]) else torch.mm(grad.t(), x)
        grad_b = grad.sum(0) if with_bias else None
    else:
        grad_w, grad_b = _native_weight_grad(grad, x, with_bias)
    return grad_w, grad_b if with_bias else grad.new_empty(0)


@_weight_grad_op.register_fake
def _(grad, x, weight, with_bias):
    return grad.new_empty(weight.shape), grad.new_empty(weight.shape[0] if with_bias else 0)


# The input gradient grad (m, out) @ weight (out, in) is a oneDNN inner product on the weight's
# transposed view, except where MKL took the weight gradients (it runs products on transposed operands at
# the machine's full rate there) and the input is wider than INPUT_GRAD_MKL_WIDTH: there MKL's plain
# product takes it. On a Zen 1 EPYC, one thread, best of 7 alternating, oneDNN's time over MKL's:
# SmolLM2's (656 rows) q and k/v 1.03, gate and up (in 576, out 1536) 1.24, down (in 1536) 1.52, LM
# head (512 rows, in 576, a sum over 49152) 1.50; the 25M model's (4144 rows) q 0.97, k/v 0.94, gate
# and up (in 512) 1.04, down (in 1536) 1.52, LM head (in 512) 0.99; the tiny model's (in 128-384)
# 0.89-0.97. oneDNN reads the transposed view slowly once it is wide, and every input wider than 512
# there ran faster through MKL.
INPUT_GRAD_MKL_WIDTH = 512


def input_grad_backend(inner: int) -> str:
    """"onednn" or "mkl": the product of the input gradient of a linear whose input has ``inner``
    features (the rule above)."""
    return "mkl" if inner > INPUT_GRAD_MKL_WIDTH and weight_grad_backend() == "mkl" else "onednn"


# The forward products take the same rule, after hybridrl's own kernel (``cpu_attention.linear``, where
# it takes the product and ``kernels_backend`` keeps it): where MKL took the weight gradients it runs
# at the machine's full rate. On an Intel Xeon (AVX-512 on two 512-bit units, MKL's AVX-512 code) its
# forward products led oneDNN's at all but one of the shapes measured, by less than ``backend()``'s
# threshold, so ``backend()`` keeps oneDNN there. One thread, cold operands, best of 7, GFLOP/s MKL /
# oneDNN: SmolLM2's (644 rows) q-k-v 208 / 186, o 199 / 190, gate-up 214 / 190, down 205 / 193, LM
# head 193 / 178 (512 rows: 189 / 174); at 256 rows 144-188 / 121-174, except the LM head's 162 / 169;
# two threads at 2048 rows 347-384 / 322-354. SmolLM2 updates alternating in one process (644 rows,
# one thread): 3.419 -> 3.357 s, in another (a busier moment) 3.673 -> 3.626 s (medians of 8 and 10);
# in `make bench` its reference pass (forward products only) 1.13 -> 1.00 s. On a Zen 1, the other
# machine where MKL took the weight gradients, the forward products tie, and the inputs wider than
# INPUT_GRAD_MKL_WIDTH are those MKL read fastest there.
def forward_backend(inner: int) -> str:
    """"onednn" or "mkl": the product of a training linear's forward whose input has ``inner`` features
    where hybridrl's kernel does not take it (the rule above)."""
    return input_grad_backend(inner)


@torch.library.custom_op(f"hybridrl::linear_input_grad_v{OP_VERSION}", mutates_args=())
def _input_grad_op(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad (m, out) @ weight (out, in) by ``input_grad_backend``."""
    if input_grad_backend(weight.shape[1]) == "mkl":
        return torch.mm(grad, weight)
    return _training_product(grad, weight.t(), None)  # the weight's transpose as (out', in')


@_input_grad_op.register_fake
def _(grad, weight):
    return grad.new_empty(grad.shape[0], weight.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad2 = _rows(grad)
    grad_x = grad_w = grad_b = None
    # the products through custom ops, so that a compiled graph keeps them opaque as well
    if ctx.needs_input_grad[0]:  # (m, out) @ (out, in)
        grad_x = _input_grad_op(grad2, weight).view(x.shape)
    with_bias = ctx.has_bias and ctx.needs_input_grad[2]
    if ctx.needs_input_grad[1]:  # (out, m) @ (m, in), and the bias's sum over m in the same pass
        grad_w, grad_b = _weight_grad_op(grad2, _rows(x), weight, with_bias)
        grad_b = grad_b if with_bias else None
    elif with_bias:
        grad_b = grad2.sum(0)
    return grad_x, grad_w, grad_b


_linear_op.register_autograd(_backward, setup_context=_setup_context)


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose fp32 CPU products (forward and backward) run through oneDNN; other
    devices and dtypes take ``F.linear``. Made by ``use_onednn_linears`` from existing modules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)

    @staticmethod
    def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` as this class computes it, for any weight (e.g. two modules'
        weights concatenated into one product)."""
        if fp32_cpu(x, weight, bias) and not torch.is_autocast_enabled("cpu"):
            return _linear_op(x, weight, bias)
        return F.linear(x, weight, bias)


def use_onednn_linears(model: nn.Module, force: bool = False) -> int:
    """Turn ``model``'s fp32 CPU ``nn.Linear`` modules (exactly that class) into ``OneDNNLinear``
    where ``backend()`` chose oneDNN (always with ``force``); returns how many were turned."""
    if not force and backend() != "onednn":
        return 0
    if force and not onednn_available():
        raise ValueError("oneDNN linears requested but this torch has no oneDNN")
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and fp32_cpu(module.weight, module.bias):
            module.__class__ = OneDNNLinear
            count += 1
    return count

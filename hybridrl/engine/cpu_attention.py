"""The trainer's attention on CPU in fp32: forward and backward as compiled SIMD kernels.

torch's CPU ``scaled_dot_product_attention`` runs its per-head products through the BLAS sgemm
(on AMD processors MKL's AVX2 code, about half the machine's rate) and, given an explicit mask,
visits every key of every query. It took 0.34 s of a 3.8 s update of the 25M benchmark model and a
fifth of the tiny model's. ``cpu_attention.c`` blocks queries in vector registers (8 at a time with
AVX-512, 6 with AVX2 + FMA, ``hybridrl/utils/hr_simd.h``) and visits only the keys between the first and the last one a block's mask allows, so the causal
upper triangle and left padding are skipped.

``hf_attention`` has the signature of a transformers attention function and falls back to
transformers' ``sdpa`` where the kernels do not apply: not fp32 CPU, head size not a multiple of 16 or above 256, dropout, a soft
cap, a float mask, sliding windows, or ``HYBRIDRL_CPU_ATTENTION=0``. Numbers equal torch's to float
rounding (sums in another order; tested against ``scaled_dot_product_attention``, values and
gradients).

The training engine switches a model from ``sdpa`` to them with ``use_for`` (on CPU at fp32), and
the shared-prompt forward (``hybridrl.engine.shared_prefix``) calls ``shared_prompt_attention``:
rows that read a group's prompt keys in place (the kernels take a second, shared key source per
row) and add their gradients to the prompt's in row order.

The same library holds the loss's token log-probs (``token_logprob`` and its backward), which
``TrainEngine`` uses for fp32 CPU logits: log_softmax(logits)[target] without making the whole
log_softmax tensor, and its gradient in one pass; ``transposed``, the transposed copies the
weight gradients' inner products read (``hybridrl.utils.cpu_matmul``), and ``weight_grad``, which
computes the small ones without such a copy; ``linear``, the training products of many rows (also
``hybridrl.utils.cpu_matmul``); and the SwiGLU of gated MLPs,
``silu(gate) * up`` and its two gradients in one pass each, and RMSNorm forward and backward
(``hybridrl.engine.cpu_layers``).
``HYBRIDRL_CPU_ATTENTION=0`` turns all of them off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from hybridrl.utils import native_build
from hybridrl.utils.cpu_matmul import fp32_cpu

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_NAME", "attention", "available", "flat_sizes", "heads_layout", "hf_attention", "linear",
           "linear_usable", "register", "rms_norm",
           "rms_norm_backward", "rms_norm_usable", "rope", "rope_usable",
           "shared_prompt_attention", "shared_prompt_usable", "simd_width", "split_flat", "swiglu",
           "swiglu_backward", "GATE_UP_BLOCK", "swiglu_fused", "swiglu_fused_backward", "swiglu_fused_usable",
           "swiglu_usable", "token_logprob", "token_logprob_backward", "token_logprob_entropy",
           "token_usable",
           "transposed", "usable", "use_for", "weight_grad", "weight_grad_usable"]

SOURCE = Path(__file__).with_name("cpu_attention.c")
MAX_HEAD_DIM = 256
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_TENSOR = [_PTR, _I64, _I64, _I64]  # pointer, strides of (rows, heads, positions)
# q, k, v, shared k, shared v; each row's group and the shared length; the mask and its strides
_OPERANDS = _TENSOR * 5 + [_PTR, _I64, _PTR, _I64, _I64]
_SHAPE = [_I64, _I64, _I64, _I64, _I64, _I64, _F32, _INT]


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("HYBRIDRL_CPU_ATTENTION", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    try:
        lib = native_build.build_library(SOURCE, "the CPU attention kernels")
    except RuntimeError as exc:
        logger.warning("hybridrl: CPU attention kernels unavailable, using torch's attention: %s", exc)
        return None
    lib.hr_attention_supported.argtypes, lib.hr_attention_supported.restype = [], _INT
    lib.hr_simd.argtypes, lib.hr_simd.restype = [], _INT
    if not lib.hr_attention_supported():
        return None  # built without AVX-512 or AVX2 + FMA
    lib.hr_attention_forward.argtypes = _OPERANDS + [_PTR, _PTR] + _SHAPE
    lib.hr_attention_backward.argtypes = (_OPERANDS + [_PTR, _PTR, _PTR] + _TENSOR + [_PTR, _PTR, _I64, _I64, _I64]
                                          + [_PTR, _PTR, _I64, _I64, _I64] + _SHAPE)
    lib.hr_attention_forward.restype = lib.hr_attention_backward.restype = _INT
    lib.hr_token_logprob.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT]
    lib.hr_token_logprob_backward.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _INT]
    lib.hr_token_logprob.restype = lib.hr_token_logprob_backward.restype = None
    lib.hr_transpose.argtypes, lib.hr_transpose.restype = [_PTR, _I64, _I64, _I64, _PTR, _INT], None
    lib.hr_weight_grad.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT]
    lib.hr_weight_grad.restype = _INT
    lib.hr_linear.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _INT]
    lib.hr_linear.restype = _INT
    lib.hr_swiglu.argtypes, lib.hr_swiglu.restype = [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _INT], None
    lib.hr_swiglu_backward.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _INT]
    lib.hr_swiglu_backward.restype = None
    lib.hr_rms_norm.argtypes, lib.hr_rms_norm.restype = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT], None
    lib.hr_rms_norm_backward.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _INT]
    lib.hr_rms_norm_backward.restype = None
    lib.hr_rope.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64,
                            _I64, _INT, _INT]
    lib.hr_rope.restype = None
    return lib


@torch.compiler.assume_constant_result  # dynamo reads it once, rather than tracing the build
def available() -> bool:
    """Whether the kernels are built and usable on this machine (AVX-512 or AVX2 + FMA, a C compiler, not turned off)."""
    return _library() is not None


def simd_width() -> int:
    """The kernels' vector code on this machine: 512 (AVX-512), 256 (AVX2 + FMA), 0 (none built)."""
    lib = _library()
    return lib.hr_simd() if lib is not None else 0


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether ``attention`` takes these operands: fp32 CPU, (B, H, T, D) / (B, KVH, S, D) with H a
    multiple of KVH and D a multiple of 16 up to 256, a bool mask (B or 1, 1, T, S) or none."""
    tensors = (query, key, value)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 4 for t in tensors):
        return False
    b, h, t, d = query.shape
    if key.shape != value.shape or key.shape[0] != b or key.shape[3] != d or h % key.shape[1]:
        return False
    if d % 16 or d > MAX_HEAD_DIM or min(b, h, t, key.shape[2]) == 0:
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
                             or mask.shape[0] not in (1, b) or tuple(mask.shape[2:]) != (t, key.shape[2])):
        return False
    return available()


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=8)
def _shared_mask(t: int, s: int, causal: bool) -> torch.Tensor:
    """(1, T, S) uint8 shared by all rows: causal, or all ones. Made once per shape, not per layer."""
    mask = torch.ones(t, s, dtype=torch.uint8)
    return (mask.tril() if causal else mask)[None]


def _mask_bytes(mask: torch.Tensor | None, t: int, s: int, causal: bool = True) -> torch.Tensor:
    """The kernels' (B', T, S) uint8 mask with a unit last stride of a bool (B or 1, 1, T, S) ``mask``;
    without one the shared causal mask (B' = 1), or all ones where not ``causal``."""
    if mask is None:
        return _shared_mask(t, s, causal)
    mask = mask[:, 0]
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    return mask.view(torch.uint8)


def _strided(t: torch.Tensor) -> list:
    return [t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)]


_NO_TENSOR = [None, 0, 0, 0]


def _operands(q, k, v, shared, mask) -> list:
    """The kernels' operand arguments; ``shared``: None, or (keys, values, group of each row) read
    as every row's first keys."""
    args = _strided(q) + _strided(k) + _strided(v)
    if shared is None:
        args += _NO_TENSOR + _NO_TENSOR + [None, 0]
    else:
        shared_k, shared_v, group = shared
        args += _strided(shared_k) + _strided(shared_v) + [group.data_ptr(), shared_k.shape[2]]
    return args + [mask.data_ptr(), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1)]


def _check(rc: int) -> None:
    if rc:
        raise MemoryError("hybridrl CPU attention: could not allocate its scratch memory")


def _shape(q, k, shared, scale) -> list:
    b, h, t, d = q.shape
    return [b, h, k.shape[1], t, k.shape[2] + (shared[0].shape[2] if shared is not None else 0), d, scale,
            torch.get_num_threads()]


def _run_forward(q, k, v, shared, mask, scale, out, lse) -> None:
    """Writes ``out`` (B, T, H, D) and ``lse`` (B, H, T), both contiguous."""
    _check(_library().hr_attention_forward(*_operands(q, k, v, shared, mask), out.data_ptr(), lse.data_ptr(),
                                           *_shape(q, k, shared, scale)))


def _run_backward(q, k, v, shared, mask, scale, out, grad_out, lse, dq, dk, dv, shared_grads=None) -> None:
    """Writes dq (any strides), dk and dv (one layout for both) and, with ``shared``, adds each row's
    gradient of its shared keys and values to its group's in ``shared_grads`` (two (U, KVH, P, D)
    tensors of one layout), row after row."""
    assert dk.stride() == dv.stride()
    if shared_grads is None:
        shared_args = [None, None, 0, 0, 0]
    else:
        dkp, dvp = shared_grads
        assert dkp.stride() == dvp.stride()
        shared_args = [dkp.data_ptr(), dvp.data_ptr(), dkp.stride(0), dkp.stride(1), dkp.stride(2)]
    _check(_library().hr_attention_backward(
        *_operands(q, k, v, shared, mask), out.data_ptr(), grad_out.data_ptr(), lse.data_ptr(), *_strided(dq),
        dk.data_ptr(), dv.data_ptr(), dk.stride(0), dk.stride(1), dk.stride(2), *shared_args,
        *_shape(q, k, shared, scale)))


# Part of the ops' names: AOTAutograd's on-disk cache keys a compiled graph by the ops it calls, not
# by their code (as ``hybridrl.utils.cpu_matmul.OP_VERSION``). Bump it when the ops change.
OP_VERSION = 1


# The attention as custom ops (forward and backward), so that a compiled transformer block traces
# through it as one opaque call and stays one graph. As a ``torch.compiler.disable`` function it was a
# graph break: dynamo compiled 7-8 frames for each variant of a block, transformers' wrappers around
# the call one by one, and each compiled region added its guards and dispatch to every layer call
# (4 compiled regions a layer in the tiny update, 1 now). On the Zen 1 EPYC: the tests that compile,
# with an empty inductor cache, 486 -> 358 s (the two-rank FSDP2 run 251 -> 147 s); the tiny
# benchmark's first update 10.5 -> 9.0 s with a warm cache, 35.5 -> 32.2 s cold; its later updates
# 1.496 -> 1.468 s (medians of 12 steps, alternating).
@torch.library.custom_op(f"hybridrl::attention_v{OP_VERSION}", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, T, H, D), lse (B, H, T)) of ``attention``; ``mask`` None: causal if ``causal``, else all keys."""
    q, k, v = _rows(query), _rows(key), _rows(value)
    b, h, t, d = q.shape
    out, lse = torch.empty(b, t, h, d), torch.empty(b, h, t)
    _run_forward(q, k, v, None, _mask_bytes(mask, t, k.shape[2], causal), scale, out, lse)
    return out, lse


@_attention_op.register_fake
def _(query, key, value, mask, causal, scale):
    b, h, t, d = query.shape
    return query.new_empty(b, t, h, d), query.new_empty(b, h, t)


@torch.library.custom_op(f"hybridrl::attention_backward_v{OP_VERSION}", mutates_args=())
def _attention_backward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                           causal: bool, scale: float, out: torch.Tensor, lse: torch.Tensor,
                           grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _rows(query), _rows(key), _rows(value)
    dq, dk, dv = torch.empty(q.shape), torch.empty(k.shape), torch.empty(v.shape)
    _run_backward(q, k, v, None, _mask_bytes(mask, q.shape[2], k.shape[2], causal), scale, out,
                  grad_out.contiguous(), lse, dq, dk, dv)
    return dq, dk, dv


@_attention_backward_op.register_fake
def _(query, key, value, mask, causal, scale, out, lse, grad_out):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _attention_setup(ctx, inputs, output) -> None:
    query, key, value, mask, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, mask, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _attention_backward(ctx, grad_out, _grad_lse):
    query, key, value, mask, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(query, key, value, mask, ctx.causal, ctx.scale, out, lse, grad_out)
    return dq, dk, dv, None, None, None


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


def flat_sizes(query: torch.Tensor, group: torch.Tensor, rows_mask: torch.Tensor) -> tuple[int, int, int]:
    """(cut, width, fed) of a shared-prompt flat sequence (``shared_prompt_attention``): the rows' mask
    is (b, 1, fed, width + fed), the prompts take the first ``cut`` positions. Read from the shapes,
    which are symbolic in a compiled block."""
    fed = rows_mask.shape[2]
    return query.shape[2] - group.shape[0] * fed, rows_mask.shape[3] - fed, fed


def _shared_layout(query, group, prompt_mask, rows_mask, lse):
    """What both shared-prompt ops take from their operands: (cut, width, fed), the group ids as
    int64, the prompts' and the rows' kernel masks, and the flat (H N) log-sum-exps ``lse`` as the
    prompts' (U, H, width) and the rows' (b, H, fed)."""
    cut, width, fed = flat_sizes(query, group, rows_mask)
    h = query.shape[1]
    lse_prompts, lse_rows = lse.split([h * cut, lse.numel() - h * cut])
    masks = _mask_bytes(prompt_mask, width, width), _mask_bytes(rows_mask, fed, width + fed)
    lses = lse_prompts.view(-1, h, width), lse_rows.view(group.shape[0], h, fed)
    return (cut, width, fed), group.contiguous().long(), masks, lses


@torch.library.custom_op(f"hybridrl::shared_prompt_attention_v{OP_VERSION}", mutates_args=())
def _shared_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: torch.Tensor,
               prompt_mask: torch.Tensor | None, rows_mask: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (1, N, H, D), the log-sum-exps (H N) flat) of ``shared_prompt_attention``: two kernel calls
    (the prompts, then the rows reading their group's prompt keys in place) writing one flat output."""
    _, h, n, d = query.shape
    out, lse = torch.empty(1, n, h, d), torch.empty(h * n)
    (cut, width, fed), group, (prompts_mask, rows_bytes), (lse_prompts, lse_rows) = _shared_layout(
        query, group, prompt_mask, rows_mask, lse)
    prompts = cut // width
    if group.numel() and (int(group.min()) < 0 or int(group.max()) >= prompts):  # the kernels index with it
        raise IndexError(f"shared_prompt_attention: group ids must lie in [0, {prompts}), got "
                         f"{int(group.min())} .. {int(group.max())}")
    (qp, qr), (kp, kr), (vp, vr) = (split_flat(x, cut, width, fed) for x in (query, key, value))
    _run_forward(qp, kp, vp, None, prompts_mask, scale, out[0, :cut], lse_prompts)
    _run_forward(qr, kr, vr, (kp, vp, group), rows_bytes, scale, out[0, cut:], lse_rows)
    return out, lse


@_shared_op.register_fake
def _(query, key, value, group, prompt_mask, rows_mask, scale):
    _, h, n, d = query.shape
    return query.new_empty(1, n, h, d), query.new_empty(h * n)


@torch.library.custom_op(f"hybridrl::shared_prompt_attention_backward_v{OP_VERSION}", mutates_args=())
def _shared_backward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: torch.Tensor,
                        prompt_mask: torch.Tensor | None, rows_mask: torch.Tensor, scale: float, out: torch.Tensor,
                        lse: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One flat gradient each for the queries, keys and values, contiguous (1, heads, N, D): a compiled
    block's backward takes its gradients in that layout (AOTAutograd's tangents with dynamic shapes)
    and copied any other (2 ms a tiny step)."""
    (cut, width, fed), group, (prompts_mask, rows_bytes), (lse_prompts, lse_rows) = _shared_layout(
        query, group, prompt_mask, rows_mask, lse)
    out, grad_out = out[0], grad_out[0].contiguous()
    dq, dk, dv = torch.empty(query.shape), torch.empty(key.shape), torch.empty(value.shape)
    (qp, qr), (kp, kr), (vp, vr) = (split_flat(x, cut, width, fed) for x in (query, key, value))
    (dqp, dqr), (dkp, dkr), (dvp, dvr) = (split_flat(x, cut, width, fed) for x in (dq, dk, dv))
    _run_backward(qp, kp, vp, None, prompts_mask, scale, out[:cut], grad_out[:cut], lse_prompts, dqp, dkp, dvp)
    # each prompt's keys and values: their own gradient (above), plus all its rows'
    _run_backward(qr, kr, vr, (kp, vp, group), rows_bytes, scale, out[cut:], grad_out[cut:], lse_rows, dqr, dkr,
                  dvr, (dkp, dvp))
    return dq, dk, dv


@_shared_backward_op.register_fake
def _(query, key, value, group, prompt_mask, rows_mask, scale, out, lse, grad_out):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _shared_setup(ctx, inputs, output) -> None:
    query, key, value, group, prompt_mask, rows_mask, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, group, prompt_mask, rows_mask, out, lse)
    ctx.scale = scale


def _shared_backward(ctx, grad_out, _grad_lse):
    query, key, value, group, prompt_mask, rows_mask, out, lse = ctx.saved_tensors
    dq, dk, dv = _shared_backward_op(query, key, value, group, prompt_mask, rows_mask, ctx.scale, out, lse, grad_out)
    return dq, dk, dv, None, None, None, None


_shared_op.register_autograd(_shared_backward, setup_context=_shared_setup)


def split_flat(x: torch.Tensor, cut: int, width: int, fed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, heads, N, D) of the shared-prompt forward's flat sequence -> the prompts' (U, heads, width,
    D) (its first ``cut`` positions) and the rows' (b, heads, fed, D), views. One ``split`` (under
    autograd its backward joins the two gradients in one copy; two slices would each fill a
    full-size zero tensor and add them up)."""
    prompts, rows = x.squeeze(0).split([cut, x.shape[2] - cut], dim=1)  # squeeze: [0]'s backward copies
    return prompts.unflatten(1, (-1, width)).transpose(0, 1), rows.unflatten(1, (-1, fed)).transpose(0, 1)


def shared_prompt_usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``shared_prompt_attention`` takes these flat operands: ``usable`` ones with batch 1."""
    return query.shape[0] == 1 and usable(query, key, value, None)


def shared_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: torch.Tensor,
                            prompt_mask: torch.Tensor | None, rows_mask: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:
    """Attention over one flat sequence of U prompts of ``width`` positions followed by b rows of
    ``fed`` positions (``hybridrl.engine.shared_prefix``), for operands ``shared_prompt_usable``
    takes: query (1, H, N, D), key and value (1, KVH, N, D), N = U width + b fed. Row i attends to
    prompt ``group[i]``'s keys, read in place, then its own, through ``rows_mask`` (b, 1, fed,
    width + fed) bool, whose shape gives ``width`` and ``fed``; prompt u attends causally over itself
    through ``prompt_mask`` (U, 1, width, width) bool (None: causal); ``scale`` None: head size **
    -0.5. Returns (1, N, H, D), contiguous; differentiable in query, key and value, whose gradients
    come back contiguous (1, heads, N, D), the layout a compiled block's backward takes them in. The
    numbers of ``attention`` on the rows with their prompts' keys gathered in front. One custom op
    (``torch.compile`` traces through it); the group ids are checked when it runs."""
    return _shared_op(query, key, value, group, prompt_mask, rows_mask, float(_scale(scale, query)))[0]


def _scale(scaling: float | None, query: torch.Tensor) -> float:
    return scaling if scaling is not None else query.shape[-1] ** -0.5


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """softmax(scale q k^T, masked) v for operands ``usable`` says it takes: query (B, H, T, D),
    key/value (B, KVH, S, D), mask (B or 1, 1, T, S) bool, True where a query may attend (None:
    causal, query t seeing keys 0 .. t, as ``scaled_dot_product_attention(is_causal=True)``). Returns
    (B, T, H, D), contiguous; differentiable in query, key and value. A query that may attend to no
    key gets zeros (and passes no gradient). One custom op (``torch.compile`` traces through it)."""
    return _attention_op(query, key, value, mask, True, float(scale))[0]


def plain(dropout: float, kwargs: dict) -> bool:
    """Whether a transformers attention call asks for nothing but softmax attention: no dropout, soft
    cap, sliding window, position bias or attention weights returned."""
    return (dropout == 0.0 and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False))


def hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs):
    """A transformers attention function (``AttentionInterface``): these kernels where ``usable``,
    else transformers' ``sdpa_attention_forward`` with the same arguments."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not plain(dropout, kwargs) or not usable(query, key, value, attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # one query without a mask (a decode step) sees every key
    causal = causal and query.shape[2] > 1
    return _attention_op(query, key, value, attention_mask, causal, float(_scale(scaling, query)))[0], None


ATTENTION_NAME = "hybridrl_cpu"  # the transformers attention implementation ``use_for`` sets
_registered: set[str] = set()


def register(name: str, fn, masks: bool = True) -> None:
    """Register ``fn`` with transformers as attention implementation ``name`` (once), with sdpa's
    masks (``masks=False``: transformers makes none, ``fn`` gets None). ``fn`` must be traceable by
    ``torch.compile`` (compiled blocks trace through it): this module's functions are, the kernels
    being custom ops."""
    if name in _registered:
        return
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, fn)
    if masks:
        AttentionMaskInterface.register(name, sdpa_mask)
    _registered.add(name)


def use_for(model: torch.nn.Module) -> bool:
    """Make ``model`` (a transformers model on ``sdpa`` attention) attend through these kernels where
    they apply, ``sdpa`` elsewhere; returns whether it was switched (not where the kernels are
    unavailable or the model is on another attention implementation)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or not available():
        return False
    register(ATTENTION_NAME, hf_attention)
    config._attn_implementation = ATTENTION_NAME
    return True


def token_usable(logits: torch.Tensor) -> bool:
    """Whether ``token_logprob`` takes these logits: fp32, CPU, contiguous, a non-empty last dimension."""
    return (fp32_cpu(logits) and logits.is_contiguous() and logits.dim() >= 1 and logits.shape[-1] > 0
            and available())


def token_logprob(logits: torch.Tensor, targets: torch.Tensor,
                  keep_exps: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits)[targets]`` over the last dimension, shaped like ``targets`` (``logits (..., V)``,
    ``targets (...)`` int64 in [0, V)), for logits ``token_usable`` takes; each row's (max, sum of
    exp(logits - max)), ``targets.shape + (2,)``; and with ``keep_exps`` those exponentials, shaped like
    the logits (else None): ``token_logprob_backward`` reads the last two instead of the logits."""
    out, stats, exps, _ = _token_kernel(logits, targets, keep_exps, False)
    return out, stats, exps


def token_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprob``'s log-probs (the same floats) and each row's entropy ``-sum(p log p)`` of
    ``softmax(logits)``, both shaped like ``targets``, from one pass over the logits; nothing is kept
    for a backward (the old log-probs' forward, under ``no_grad``)."""
    out, _, _, entropy = _token_kernel(logits, targets, False, True)
    return out, entropy


def _token_kernel(logits: torch.Tensor, targets: torch.Tensor, keep_exps: bool,
                  entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    vocab = logits.shape[-1]
    targets = targets.contiguous().long()
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        bad = targets[(targets < 0) | (targets >= vocab)][0]
        raise IndexError(f"token_logprob: target token id {int(bad)} outside the logits' vocabulary of {vocab}")
    out, stats = torch.empty(targets.shape), torch.empty(*targets.shape, 2)
    exps = torch.empty_like(logits) if keep_exps else None
    ent = torch.empty(targets.shape) if entropy else None
    _library().hr_token_logprob(logits.data_ptr(), targets.data_ptr(), targets.numel(), vocab, out.data_ptr(),
                                stats.data_ptr(), exps.data_ptr() if keep_exps else None,
                                ent.data_ptr() if entropy else None, torch.get_num_threads())
    return out, stats, exps, ent


def token_logprob_backward(exps: torch.Tensor, targets: torch.Tensor, stats: torch.Tensor,
                           grad: torch.Tensor) -> torch.Tensor:
    """The logits' gradient of ``token_logprob``'s first output for ``grad`` (shaped like targets):
    ``grad * (onehot(targets) - softmax(logits))``, in one pass over the exponentials and the stats
    ``token_logprob(..., keep_exps=True)`` returned (they are left as they are)."""
    out = torch.empty_like(exps)
    grad = grad.contiguous()
    _library().hr_token_logprob_backward(exps.data_ptr(), targets.contiguous().long().data_ptr(), stats.data_ptr(),
                                         grad.data_ptr(), targets.numel(), exps.shape[-1], out.data_ptr(),
                                         torch.get_num_threads())
    return out


def swiglu_usable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether ``swiglu`` takes these operands: fp32 CPU tensors of one shape (any strides)."""
    return fp32_cpu(gate, up) and gate.shape == up.shape and available()


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, contiguous, for operands ``swiglu_usable`` takes."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape)
    cols = gate.shape[-1] if gate.dim() else 1
    _library().hr_swiglu(gate.data_ptr(), up.data_ptr(), cols, 16, out.data_ptr(), gate.numel() // max(cols, 1), cols,
                         torch.get_num_threads())
    return out


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients (gate's, up's) of ``swiglu``'s output for ``grad`` (same shape), in one pass."""
    gate, up, grad = gate.contiguous(), up.contiguous(), grad.contiguous()
    d_gate, d_up = torch.empty(gate.shape), torch.empty(gate.shape)
    cols = gate.shape[-1] if gate.dim() else 1
    _library().hr_swiglu_backward(gate.data_ptr(), up.data_ptr(), cols, 16, grad.data_ptr(), d_gate.data_ptr(),
                                  d_up.data_ptr(), gate.numel() // max(cols, 1), cols, torch.get_num_threads())
    return d_gate, d_up


GATE_UP_BLOCK = 16  # gate values, then as many up values, in turn along a fused row (``swiglu_fused``)


def swiglu_fused_usable(gate_up: torch.Tensor) -> bool:
    """Whether ``swiglu_fused`` takes ``gate_up``: fp32 CPU, its last dimension a multiple of 2 x
    ``GATE_UP_BLOCK``."""
    return (fp32_cpu(gate_up) and gate_up.dim() >= 1 and gate_up.shape[-1] % (2 * GATE_UP_BLOCK) == 0
            and available())


def swiglu_fused(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, contiguous ``(..., C / 2)``, of a fused gate-up product's rows ``(..., C)``,
    which alternate ``GATE_UP_BLOCK`` gate values and as many up values (the product of weights
    interleaved so, ``cpu_layers.interleave_rows``): each row is read once, in memory order."""
    gate_up = gate_up.contiguous()
    cols = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], cols)
    _library().hr_swiglu(gate_up.data_ptr(), gate_up.data_ptr() + 4 * GATE_UP_BLOCK, 2 * cols, 2 * GATE_UP_BLOCK,
                         out.data_ptr(), out.numel() // max(cols, 1), cols, torch.get_num_threads())
    return out


def swiglu_fused_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``swiglu_fused``'s output for ``grad``, laid out as ``gate_up``, in one pass."""
    gate_up, grad = gate_up.contiguous(), grad.contiguous()
    cols = gate_up.shape[-1] // 2
    d = torch.empty(gate_up.shape)
    _library().hr_swiglu_backward(gate_up.data_ptr(), gate_up.data_ptr() + 4 * GATE_UP_BLOCK, 2 * cols,
                                  2 * GATE_UP_BLOCK, grad.data_ptr(), d.data_ptr(), d.data_ptr() + 4 * GATE_UP_BLOCK,
                                  grad.numel() // max(cols, 1), cols, torch.get_num_threads())
    return d


NORM_BLOCK = 64  # rows per partial sum of the RMSNorm weight's gradient (cpu_attention.c)


def rms_norm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm`` takes these operands: fp32 CPU, ``weight`` (C,) for ``x`` (..., C)."""
    return (fp32_cpu(x, weight) and x.dim() >= 1 and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
            and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))`` for operands ``rms_norm_usable`` takes, and each
    row's 1 / sqrt(mean + eps) (``x.shape[:-1]``) for ``rms_norm_backward``."""
    x, weight = x.contiguous(), weight.contiguous()
    out, rstd = torch.empty(x.shape), torch.empty(x.shape[:-1])
    cols = x.shape[-1]
    _library().hr_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rstd.data_ptr(), x.numel() // max(cols, 1),
                           cols, eps, torch.get_num_threads())
    return out, rstd


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients (x's, weight's) of ``rms_norm``'s output for ``grad``, in one pass over the rows;
    the same floats on any number of threads."""
    x, weight, rstd, grad = x.contiguous(), weight.contiguous(), rstd.contiguous(), grad.contiguous()
    cols = x.shape[-1]
    rows = x.numel() // max(cols, 1)
    d_x, d_weight = torch.empty(x.shape), torch.empty(cols)
    partial = torch.empty(-(-rows // NORM_BLOCK), cols)
    _library().hr_rms_norm_backward(x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), grad.data_ptr(), d_x.data_ptr(),
                                    d_weight.data_ptr(), partial.data_ptr(), rows, cols, torch.get_num_threads())
    return d_x, d_weight


def transposed(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a 2-D tensor; through the kernels for fp32 CPU rows with a unit
    last stride (a blocked register transpose reading ahead, streaming stores for outputs of 8 MB and
    more: at the update's shapes 0.04-0.9 ms against torch's 0.14-2.1 ms, e.g. (656, 1536) 0.10 vs
    0.36 ms; the SmolLM2 LM head's gradient (512 x 49152) 12.5 vs 24 ms)."""
    if not (x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(1) == 1
            and x.numel() > 0 and available()):
        return x.t().contiguous()
    rows, cols = x.shape
    out = torch.empty(cols, rows)
    _library().hr_transpose(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


WEIGHT_GRAD_MAX_OUTPUTS = 128 * 1024  # hr_weight_grad keeps them all in L2 (512 KB)

# ``linear`` takes products of at least this many rows (its copy of the weight is made per call) and
# weights of at most this many floats (its copy is passed over in blocks of 512 KB): the shapes
# measured faster than oneDNN's (cpu_attention.c, "linear products").
LINEAR_MIN_ROWS = 1024
LINEAR_MAX_WEIGHT = 2 * 1024 * 1024


def linear_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes ``x (m, in) @ weight (out, in)^T``: fp32 CPU, x's last stride 1 (weight
    in any layout, e.g. the transposed view an input gradient reads), out a multiple of 16, at least
    ``LINEAR_MIN_ROWS`` rows and at most ``LINEAR_MAX_WEIGHT`` weights, on an AVX-512 build."""
    return (fp32_cpu(x, weight) and x.dim() == weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1 and x.shape[1] > 0 and weight.shape[0] % 16 == 0 and weight.shape[0] > 0
            and x.shape[0] >= LINEAR_MIN_ROWS and weight.numel() <= LINEAR_MAX_WEIGHT and simd_width() == 512)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (m, out) for operands ``linear_usable`` takes, bias contiguous fp32 or
    None: each output summed over ``in`` in order by one thread, so the same floats on any number."""
    out = torch.empty(x.shape[0], weight.shape[0])
    bias = None if bias is None else bias.contiguous()
    rc = _library().hr_linear(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], weight.data_ptr(), weight.stride(0),
                              weight.stride(1), weight.shape[0], None if bias is None else bias.data_ptr(),
                              out.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"hr_linear refused operands {tuple(x.shape)} and {tuple(weight.shape)} ({rc})")
    return out


def weight_grad_usable(grad: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the weight gradients take ``weight_grad`` for these operands: fp32 CPU (m, out) and (m,
    in) with unit last strides, ``in`` a multiple of 16, at most ``WEIGHT_GRAD_MAX_OUTPUTS`` outputs
    (out x in), on an AVX-512 build: where it was measured faster than oneDNN's products with their
    transposed copies. The tiny model's weight gradients took 0.145 -> 0.12-0.13 s of an update (its
    updates 0.510 -> 0.486 s, steps alternating in one process, a Zen 4); the 25M model's, of which
    it takes k and v, 2.142 against 2.146 s. All of the 25M model's, computed in 256 x 256 blocks by
    a trial version, took 2.18 s against oneDNN's 2.10, and the AVX2 build ran at 70-90
    GFLOP/s on them where oneDNN's AVX-512 products ran at 98-105; no AVX2-only machine has measured
    it against oneDNN's AVX2 products, so those machines keep oneDNN's."""
    return (fp32_cpu(grad, x) and grad.dim() == x.dim() == 2 and grad.shape[0] == x.shape[0]
            and grad.stride(1) == x.stride(1) == 1 and x.shape[1] % 16 == 0 and grad.shape[1] > 0
            and x.shape[1] > 0 and grad.shape[1] * x.shape[1] <= WEIGHT_GRAD_MAX_OUTPUTS and simd_width() == 512)


def weight_grad(grad: torch.Tensor, x: torch.Tensor,
                with_bias: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``grad.t() @ x``, a linear's weight gradient, and with ``with_bias`` its bias's, ``grad.sum(0)``,
    else None) for operands ``weight_grad_usable`` takes, reading both in place (no transposed copy,
    unlike a BLAS's inner product here): sums over the rows in row order, so the same floats on any
    number of threads; the bias's from the same pass over grad."""
    out = torch.empty(grad.shape[1], x.shape[1])
    bias = torch.empty(grad.shape[1]) if with_bias else None
    rc = _library().hr_weight_grad(grad.data_ptr(), grad.stride(0), x.data_ptr(), x.stride(0), grad.shape[0],
                                   grad.shape[1], x.shape[1], out.data_ptr(),
                                   bias.data_ptr() if with_bias else None, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"hr_weight_grad refused operands {tuple(grad.shape)} and {tuple(x.shape)}")
    return out, bias


def rope_usable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rope`` takes these operands: fp32 CPU, ``x (B, H, T, D)`` and ``cos``, ``sin`` ``(B or 1,
    T, D)`` of one layout, each with its last dimension contiguous, D a multiple of 32."""
    if not (fp32_cpu(x, cos, sin) and x.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
            and cos.stride() == sin.stride() and available()):
        return False
    b, _, t, d = x.shape
    return (d % 32 == 0 and cos.shape[1:] == (t, d) and cos.shape[0] in (1, b) and x.stride(-1) == 1
            and cos.stride(-1) == 1)


def heads_layout(shape: torch.Size) -> torch.Tensor:
    """An empty ``(B, H, T, D)`` tensor laid out as ``(B, T, H, D)``: the transposed view of a projection's output."""
    b, h, t, d = shape
    return torch.empty(b, t, h, d).transpose(1, 2)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` (transformers' rotary embedding, cos and sin broadcast over the
    heads) for operands ``rope_usable`` takes, in ``x``'s layout; ``backward``: the gradient of that
    for ``x`` = the output's gradient, ``g cos + rotate_half^T(g sin)``, laid out as ``(B, T, H, D)``
    (the heads' projection's layout, whose gradient it becomes without a copy)."""
    out = heads_layout(x.shape) if backward else torch.empty_like(x)
    b, h, t, d = x.shape
    csb = cos.stride(0) if cos.shape[0] > 1 else 0
    _library().hr_rope(x.data_ptr(), *x.stride()[:3], cos.data_ptr(), sin.data_ptr(), csb, cos.stride(1), b, h, t, d,
                       out.data_ptr(), *out.stride()[:3], int(backward), torch.get_num_threads())
    return out

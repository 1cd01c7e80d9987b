"""The trainer's attention on CPU in fp32: forward and backward as compiled AVX-512 kernels.

torch's CPU ``scaled_dot_product_attention`` runs its per-head products through the BLAS sgemm
(on AMD processors MKL's AVX2 code, about half the machine's rate) and, given an explicit mask,
visits every key of every query. It took 0.34 s of a 3.8 s update of the 25M benchmark model and a
fifth of the tiny model's. ``cpu_attention.c`` blocks 8 queries at a time in AVX-512 registers and
visits only the keys between the first and the last one a block's mask allows, so the causal
upper triangle and left padding are skipped.

``hf_attention`` has the signature of a transformers attention function and falls back to
transformers' ``sdpa`` where the kernels do not apply: not fp32 CPU, head size not a multiple of 16 or above 256, dropout, a soft
cap, a float mask, sliding windows, or ``HYBRIDRL_CPU_ATTENTION=0``. Numbers equal torch's to float
rounding (sums in another order; tested against ``scaled_dot_product_attention``, values and
gradients).

The training engine switches a model from ``sdpa`` to them with ``use_for`` (on CPU at fp32), and
the shared-prompt forward (``hybridrl.engine.shared_prefix``) calls ``hf_attention`` as well.

The same library holds the loss's token log-probs (``token_logprob`` and its backward), which
``TrainEngine`` uses for fp32 CPU logits: log_softmax(logits)[target] without making the whole
log_softmax tensor, and its gradient in one pass; and ``transposed``, the transposed copies the
weight gradients' inner products read (``hybridrl.utils.cpu_matmul``). ``HYBRIDRL_CPU_ATTENTION=0``
turns all of them off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from hybridrl.utils import native_build

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_NAME", "attention", "available", "hf_attention", "register", "token_logprob",
           "token_logprob_backward", "token_usable", "transposed", "usable", "use_for"]

SOURCE = Path(__file__).with_name("cpu_attention.c")
MAX_HEAD_DIM = 256
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_COMMON = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64]
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
    if not lib.hr_attention_supported():
        return None  # built without AVX-512
    lib.hr_attention_forward.argtypes = _COMMON + [_PTR, _PTR] + _SHAPE
    lib.hr_attention_backward.argtypes = _COMMON + [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR] + _SHAPE
    lib.hr_attention_forward.restype = lib.hr_attention_backward.restype = _INT
    lib.hr_token_logprob.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _INT]
    lib.hr_token_logprob_backward.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _INT]
    lib.hr_token_logprob.restype = lib.hr_token_logprob_backward.restype = None
    lib.hr_transpose.argtypes, lib.hr_transpose.restype = [_PTR, _I64, _I64, _I64, _PTR, _INT], None
    return lib


def available() -> bool:
    """Whether the kernels are built and usable on this machine (AVX-512, a C compiler, not turned off)."""
    return _library() is not None


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


def _mask_bytes(mask: torch.Tensor | None, t: int, s: int) -> torch.Tensor:
    """(B', T, S) uint8 with a unit last stride (B' = 1 for a shared mask); causal when None."""
    if mask is None:
        return _shared_mask(t, s, True)
    mask = mask[:, 0]
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    return mask.view(torch.uint8)


def _pointers(q, k, v, mask):
    return [q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(), k.stride(0),
            k.stride(1), k.stride(2), mask.data_ptr(), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1)]


def _check(rc: int) -> None:
    if rc:
        raise MemoryError("hybridrl CPU attention: could not allocate its scratch memory")


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, scale):
        q, k, v = _rows(query), _rows(key), _rows(value)
        if k.stride() != v.stride():
            k, v = k.contiguous(), v.contiguous()
        b, h, t, d = q.shape
        kvh, s = k.shape[1], k.shape[2]
        out = torch.empty(b, t, h, d)
        lse = torch.empty(b, h, t)
        _check(_library().hr_attention_forward(*_pointers(q, k, v, mask), out.data_ptr(), lse.data_ptr(), b, h, kvh,
                                               t, s, d, scale, torch.get_num_threads()))
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        b, h, t, d = q.shape
        kvh, s = k.shape[1], k.shape[2]
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.empty(b, h, t, d), torch.empty(b, kvh, s, d), torch.empty(b, kvh, s, d)
        _check(_library().hr_attention_backward(*_pointers(q, k, v, mask), out.data_ptr(), grad_out.data_ptr(),
                                                lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), b, h,
                                                kvh, t, s, d, ctx.scale, torch.get_num_threads()))
        return dq, dk, dv, None, None


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """softmax(scale q k^T, masked) v for operands ``usable`` says it takes: query (B, H, T, D),
    key/value (B, KVH, S, D), mask (B or 1, 1, T, S) bool, True where a query may attend (None:
    causal, query t seeing keys 0 .. t, as ``scaled_dot_product_attention(is_causal=True)``). Returns (B, T, H, D), contiguous; differentiable in
    query, key and value. A query that may attend to no key gets zeros (and passes no gradient)."""
    return _Attention.apply(query, key, value, _mask_bytes(mask, query.shape[2], key.shape[2]), float(scale))


def hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs):
    """A transformers attention function (``AttentionInterface``): these kernels where ``usable``,
    else transformers' ``sdpa_attention_forward`` with the same arguments."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (dropout == 0.0 and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None
             and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False))
    if not plain or not usable(query, key, value, attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    t, s = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask = _shared_mask(t, s, causal and t > 1)
    else:
        mask = _mask_bytes(attention_mask, t, s)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _Attention.apply(query, key, value, mask, float(scale)), None


ATTENTION_NAME = "hybridrl_cpu"  # the transformers attention implementation ``use_for`` sets
_registered: set[str] = set()


def register(name: str, fn, masks: bool = True) -> None:
    """Register ``fn`` with transformers as attention implementation ``name`` (once), with sdpa's
    masks (``masks=False``: transformers makes none, ``fn`` gets None); it runs outside
    ``torch.compile``: compiled blocks break their graph around the call."""
    if name in _registered:
        return
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, torch.compiler.disable(fn))
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
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and logits.dim() >= 1 and logits.shape[-1] > 0 and available())


def token_logprob(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits)[targets]`` over the last dimension, shaped like ``targets`` (``logits (..., V)``,
    ``targets (...)`` int64 in [0, V)), for logits ``token_usable`` takes; and each row's (max,
    sum of exp(logits - max)), ``targets.shape + (2,)``, for ``token_logprob_backward``."""
    vocab = logits.shape[-1]
    targets = targets.contiguous().long()
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        bad = targets[(targets < 0) | (targets >= vocab)][0]
        raise IndexError(f"token_logprob: target token id {int(bad)} outside the logits' vocabulary of {vocab}")
    out, stats = torch.empty(targets.shape), torch.empty(*targets.shape, 2)
    _library().hr_token_logprob(logits.data_ptr(), targets.data_ptr(), targets.numel(), vocab, out.data_ptr(),
                                stats.data_ptr(), torch.get_num_threads())
    return out, stats


def token_logprob_backward(logits: torch.Tensor, targets: torch.Tensor, stats: torch.Tensor,
                           grad: torch.Tensor) -> torch.Tensor:
    """The logits' gradient of ``token_logprob``'s first output for ``grad`` (shaped like targets):
    ``grad * (onehot(targets) - softmax(logits))``, in one pass."""
    out = torch.empty_like(logits)
    grad = grad.contiguous()
    _library().hr_token_logprob_backward(logits.data_ptr(), targets.contiguous().long().data_ptr(), stats.data_ptr(),
                                         grad.data_ptr(), targets.numel(), logits.shape[-1], out.data_ptr(),
                                         torch.get_num_threads())
    return out


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

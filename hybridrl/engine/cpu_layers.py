"""A decoder layer's SwiGLU and RMSNorm as single ops on CPU: hybridrl's kernels forward and backward.

What a compiled block (``hybridrl.engine.compile``) leaves to inductor besides the products and the
attention are its elementwise passes, and two of them ran far below the memory's rate on a Zen 1
(the tiny benchmark's update, (8288, 384) and (8288, 128) operands per layer, one thread):

- the gated MLP's ``silu(gate) * up`` (Llama, Qwen2, Qwen3, Mistral: ``down_proj(act_fn(gate_proj(x))
  * up_proj(x))`` with SiLU): inductor fused it into one loop each way, whose exponential (Sleef's, to
  1 ulp) took most of their 7.5 ms forward and 12 ms backward per layer; ``hr_swiglu`` /
  ``hr_swiglu_backward`` take 5.9 and 8.3 (eager torch: 24 for both);
- RMSNorm's weight gradient, a sum down the columns that inductor ran 8 columns at a time, each a pass
  over every row of seven operands: 5.3 ms per layer for the layer's two norms. ``hr_rms_norm_backward``
  makes the input's and the weight's gradients in one pass over the rows.

``use_cpu_layers(model)`` (the training engine calls it for fp32 CPU models, like
``use_onednn_linears``) gives each such MLP and norm a forward that calls these custom ops, which
``torch.compile`` keeps opaque; other devices and dtypes, and machines without the kernels
(``cpu_attention.available``), take torch's ops as before. Numbers equal torch's to float rounding
(tested values and gradients, ``tests/engine/test_cpu_layers.py``); the norm's are the same on any
number of threads.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.engine import cpu_attention
from hybridrl.models.utils import SILU_CLASSES

__all__ = ["FUSED_MLPS", "FUSED_NORMS", "ROPE_ATTENTIONS", "rms_norm", "rope", "swiglu", "use_cpu_layers"]

# transformers classes whose forward is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
FUSED_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
# ... and exactly ``weight * (x.float() * rsqrt(x.float().pow(2).mean(-1) + variance_epsilon)).to(dtype)``
FUSED_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
# ... whose forward calls its modeling module's ``apply_rotary_pos_emb(q, k, cos, sin)``
ROPE_ATTENTIONS = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention")


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------------- SwiGLU
@torch.library.custom_op("hybridrl::swiglu_v1", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return cpu_attention.swiglu(gate, up)


@_swiglu_op.register_fake
def _(gate, up):
    return _contiguous_like(gate)


@torch.library.custom_op("hybridrl::swiglu_backward_v1", mutates_args=())
def _swiglu_backward_op(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_attention.swiglu_backward(gate, up, grad)


@_swiglu_backward_op.register_fake
def _(gate, up, grad):
    return _contiguous_like(gate), _contiguous_like(up)


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_grads(ctx, grad):
    gate, up = ctx.saved_tensors
    return _swiglu_backward_op(gate, up, grad)


_swiglu_op.register_autograd(_swiglu_grads, setup_context=_save_inputs)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: through the kernels for fp32 CPU operands of one shape, else torch's ops."""
    if cpu_attention.swiglu_usable(gate, up):
        return _swiglu_op(gate, up)
    return F.silu(gate) * up


# ------------------------------------------------------------------------------------ RMSNorm
@torch.library.custom_op("hybridrl::rms_norm_v1", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_attention.rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return _contiguous_like(x), x.new_empty(x.shape[:-1])


@torch.library.custom_op("hybridrl::rms_norm_backward_v1", mutates_args=())
def _rms_norm_backward_op(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                          grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_attention.rms_norm_backward(x, weight, rstd, grad)


@_rms_norm_backward_op.register_fake
def _(x, weight, rstd, grad):
    return _contiguous_like(x), _contiguous_like(weight)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grads(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    d_x, d_weight = _rms_norm_backward_op(x, weight, rstd, grad)
    return d_x, d_weight, None


_rms_norm_op.register_autograd(_rms_norm_grads, setup_context=_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))``: through the kernels for fp32 CPU operands, else
    torch's ops (as transformers' RMSNorm computes it, in fp32)."""
    if cpu_attention.rms_norm_usable(x, weight):
        return _rms_norm_op(x, weight, float(eps))[0]
    dtype = x.dtype
    x = x.to(torch.float32)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


# ------------------------------------------------------------------------ rotary embedding
@torch.library.custom_op("hybridrl::rope_v1", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_attention.rope(q, cos, sin), cpu_attention.rope(k, cos, sin)


@_rope_op.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("hybridrl::rope_backward_v1", mutates_args=())
def _rope_backward_op(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_attention.rope(grad_q, cos, sin, backward=True), cpu_attention.rope(grad_k, cos, sin, backward=True)


@_rope_backward_op.register_fake
def _(grad_q, grad_k, cos, sin):
    return cpu_attention.heads_layout(grad_q.shape), cpu_attention.heads_layout(grad_k.shape)


def _rope_setup(ctx, inputs, output) -> None:
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _rope_grads(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors

    def usable(g):  # the kernel reads rows with a contiguous last dimension
        return g if g.stride(-1) == 1 else g.contiguous()

    d_q, d_k = _rope_backward_op(usable(grad_q), usable(grad_k), cos, sin)
    return d_q, d_k, None, None


_rope_op.register_autograd(_rope_grads, setup_context=_rope_setup)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` through the kernels, or None where they do
    not take the operands (fp32 CPU ``(B, H, T, D)`` heads, ``(B or 1, T, D)`` cos and sin without
    gradients, D a multiple of 32, ``unsqueeze_dim=1``)."""
    if (unsqueeze_dim != 1 or cos.requires_grad or sin.requires_grad or not cpu_attention.rope_usable(q, cos, sin)
            or not cpu_attention.rope_usable(k, cos, sin)):
        return None
    return _rope_op(q, k, cos, sin)


def _rope_dispatcher(original):
    """A stand-in for a modeling module's ``apply_rotary_pos_emb``: ``rope`` where it applies, else
    ``original`` with the same arguments."""
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if len(args) + len(kwargs) <= 1 and set(kwargs) <= {"unsqueeze_dim"}:
            out = rope(q, k, cos, sin, unsqueeze_dim)
            if out is not None:
                return out
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.hybridrl_original = original
    return apply_rotary_pos_emb


def _use_rope_kernel(module: nn.Module) -> bool:
    """Point the global ``apply_rotary_pos_emb`` of ``module``'s modeling module (the name its
    attention's forward calls) at ``_rope_dispatcher``, once; whether it is."""
    modeling = sys.modules.get(type(module).__module__)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if not hasattr(original, "hybridrl_original"):
        modeling.apply_rotary_pos_emb = _rope_dispatcher(original)
    return True


# ------------------------------------------------------------------------------------- models
def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.variance_epsilon)


def use_cpu_layers(model: nn.Module) -> dict[str, int]:
    """Give each MLP of ``model`` whose class is one of ``FUSED_MLPS`` with a SiLU activation, and
    each norm of a ``FUSED_NORMS`` class, the forwards above (attributes of the modules: classes,
    parameters and state dicts stay as they are), and the attentions of ``ROPE_ATTENTIONS`` classes
    the rotary embedding's kernel; returns how many of each. None where the kernels are unavailable.

    The rotary embedding is a function the attention's forward calls by its global name, so that
    name is what changes, in the modeling module (``transformers.models.qwen2.modeling_qwen2`` ...):
    for every model of that architecture in the process, fp32 CPU operands take the kernel, the
    same floats as transformers' eager ops; any other call goes on to transformers' function."""
    counts = {"mlp": 0, "norm": 0, "rope": 0}
    if not cpu_attention.available():
        return counts
    for module in model.modules():
        name = type(module).__name__
        if name in FUSED_MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU_CLASSES:
            module.forward = types.MethodType(_mlp_forward, module)
            counts["mlp"] += 1
        elif name in FUSED_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)
            counts["norm"] += 1
        elif name in ROPE_ATTENTIONS and _use_rope_kernel(module):
            counts["rope"] += 1
    return counts

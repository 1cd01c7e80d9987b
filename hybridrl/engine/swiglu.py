"""The gated MLP's ``silu(gate) * up`` as one op on CPU: hybridrl's kernels forward and backward.

Llama, Qwen2, Qwen3 and Mistral MLPs compute ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with
SiLU. Eager torch makes three passes over the (tokens, intermediate) tensors forward (``silu``, the
product, and the sigmoid again in the backward's ``silu_backward``) and more backward; a compiled
block fuses them into one loop each way, whose exponential (Sleef's, to 1 ulp) took most of its time
on a Zen 1: 7.5 ms forward and 12 ms backward per layer of the tiny benchmark's update, (8288, 384)
operands. ``cpu_attention.c``'s ``hr_swiglu`` / ``hr_swiglu_backward`` take 6.5 and 8 ms (eager:
24 ms for both), with the kernels' exponential (``hybridrl/utils/hr_simd.h``).

``use_fused_swiglu(model)`` (the training engine calls it for fp32 CPU models, like
``use_onednn_linears``) gives each such MLP a forward that calls ``swiglu``, a custom op that
``torch.compile`` keeps opaque; other devices and dtypes, and machines without the kernels, take
``silu(gate) * up`` as before. Numbers equal torch's to float rounding (its exp and ours differ by
about an ulp; tested values and gradients).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.engine import cpu_attention

__all__ = ["FUSED_MLPS", "swiglu", "use_fused_swiglu"]

# transformers MLP classes whose forward is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
FUSED_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
_SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' (ACT2FN["silu"])


@torch.library.custom_op("hybridrl::swiglu_v1", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return cpu_attention.swiglu(gate, up)


@_swiglu_op.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("hybridrl::swiglu_backward_v1", mutates_args=())
def _swiglu_backward_op(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_attention.swiglu_backward(gate, up, grad)


@_swiglu_backward_op.register_fake
def _(gate, up, grad):
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return _swiglu_backward_op(gate, up, grad)


_swiglu_op.register_autograd(_backward, setup_context=_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: through the kernels for fp32 CPU operands of one shape, else torch's ops."""
    if cpu_attention.swiglu_usable(gate, up):
        return _swiglu_op(gate, up)
    return F.silu(gate) * up


def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def use_fused_swiglu(model: nn.Module) -> int:
    """Give each MLP of ``model`` whose class is one of ``FUSED_MLPS`` with a SiLU activation the
    forward above (an attribute of the module: its class, parameters and state dict stay as they
    are); returns how many. None where the kernels are unavailable."""
    if not cpu_attention.available():
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ in FUSED_MLPS and type(getattr(module, "act_fn", None)).__name__ in _SILU:
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count

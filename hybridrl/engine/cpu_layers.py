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

Where a layer's input is narrow (``FUSE_MAX_INPUT``), the projections that read the same input run
as one product on their concatenated weights, rebuilt from the modules' own at every forward (the
state dict is unchanged): gate and up on their rows interleaved 16 at a time, so that
``swiglu_fused`` reads each output row once in memory order, and an attention's q, k and v (Llama,
Qwen2, Qwen3, Mistral without a key-value cache: ``_attention_forward``, transformers' own forward
with the one product; any call with a cache goes to transformers').

``use_cpu_layers(model)`` (the training engine calls it for fp32 CPU models, like
``use_onednn_linears``) gives each such MLP and norm a forward that calls these custom ops, which
``torch.compile`` keeps opaque; other devices and dtypes, and machines without the kernels
(``cpu_attention.available``), take torch's ops as before. Numbers equal torch's to float rounding
(tested values and gradients, ``tests/engine/test_cpu_layers.py``); the norm's are the same on any
number of threads.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.engine import cpu_attention
from hybridrl.models.loading import without_hub_kernels
from hybridrl.models.utils import SILU_CLASSES
from hybridrl.utils.cpu_matmul import OneDNNLinear, fp32_cpu

__all__ = ["FUSED_MLPS", "FUSED_NORMS", "FUSE_MAX_INPUT", "ROPE_ATTENTIONS", "interleave_rows", "rms_norm", "rope",
           "swiglu", "swiglu_fused", "use_cpu_layers"]

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


def _grads_from_inputs(backward_op):
    """An op's autograd backward that passes its saved inputs (``_save_inputs``) and the output's
    gradient to ``backward_op``."""
    return lambda ctx, grad: backward_op(*ctx.saved_tensors, grad)


_swiglu_op.register_autograd(_grads_from_inputs(_swiglu_backward_op), setup_context=_save_inputs)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: through the kernels for fp32 CPU operands of one shape, else torch's ops."""
    if cpu_attention.swiglu_usable(gate, up):
        return _swiglu_op(gate, up)
    return F.silu(gate) * up


@torch.library.custom_op("hybridrl::swiglu_fused_v1", mutates_args=())
def _swiglu_fused_op(gate_up: torch.Tensor) -> torch.Tensor:
    return cpu_attention.swiglu_fused(gate_up)


@_swiglu_fused_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("hybridrl::swiglu_fused_backward_v1", mutates_args=())
def _swiglu_fused_backward_op(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return cpu_attention.swiglu_fused_backward(gate_up, grad)


@_swiglu_fused_backward_op.register_fake
def _(gate_up, grad):
    return _contiguous_like(gate_up)


_swiglu_fused_op.register_autograd(_grads_from_inputs(_swiglu_fused_backward_op), setup_context=_save_inputs)


def swiglu_fused(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a product on ``interleave_rows(gate_w, up_w)``, through the kernels
    (``cpu_attention.swiglu_fused``, fp32 CPU rows a multiple of 32 wide; else torch's ops)."""
    if cpu_attention.swiglu_fused_usable(gate_up):
        return _swiglu_fused_op(gate_up)
    gate, up = gate_up.unflatten(-1, (-1, 2, cpu_attention.GATE_UP_BLOCK)).unbind(-2)
    return F.silu(gate.flatten(-2)) * up.flatten(-2)


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
def interleave_rows(a: torch.Tensor, b: torch.Tensor, block: int = cpu_attention.GATE_UP_BLOCK) -> torch.Tensor:
    """Rows of ``a`` and ``b`` (one shape, rows a multiple of ``block``) in turn, ``block`` at a time:
    the fused gate-up weight (or bias) whose product ``swiglu_fused`` reads."""
    return torch.stack([a.unflatten(0, (-1, block)), b.unflatten(0, (-1, block))], 1).flatten(0, 2)


# Projections of one input run as one product on their concatenated weights up to this input width.
# Products with a narrow input run well below the peak, and one product of the summed width
# recovers part of it; backward, one input gradient replaces several and their sum. Measured in whole
# updates, alternating per step in one process (a Zen 4, one thread): the tiny model (width 128)
# 0.509 -> 0.480 s (gate and up alone 0.500, q, k and v alone 0.491); the 25M model (512) 7.14 ->
# 7.09 s; SmolLM2 (576) 5.49 -> 5.58 s, gate and up alone 5.63 (their weights, 7 MB a layer, are
# copied into the fused one every forward, and its gradient out again), q, k and v alone 5.50.
FUSE_MAX_INPUT = 256


def _one_product(*linears: nn.Module) -> bool:
    """Whether ``linears`` run as one product on their concatenated weights: plain linears of one
    kind (``nn.Linear`` or ``OneDNNLinear``, not e.g. LoRA-wrapped), without hooks, of one input
    width up to ``FUSE_MAX_INPUT``, all with a bias or none, fp32."""
    kind = type(linears[0])
    return (kind in (nn.Linear, OneDNNLinear) and all(type(m) is kind for m in linears)
            and len({m.weight.shape[1] for m in linears}) == 1 and linears[0].weight.shape[1] <= FUSE_MAX_INPUT
            and len({m.bias is None for m in linears}) == 1
            and not any(m._forward_hooks or m._forward_pre_hooks for m in linears)
            and fp32_cpu(*(m.weight for m in linears)))


def _product(kind: type, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as a module of class ``kind`` computes it."""
    return OneDNNLinear.product(x, weight, bias) if kind is OneDNNLinear else F.linear(x, weight, bias)


def _fused_gate_up(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``gate_proj(x)`` and ``up_proj(x)`` as one product on their interleaved weights (``swiglu_fused``'s
    operand), or None where they cannot be one product (``_one_product``) or the kernel does not take
    their width."""
    gate, up = mlp.gate_proj, mlp.up_proj
    if (not _one_product(gate, up) or gate.weight.shape != up.weight.shape
            or gate.weight.shape[0] % cpu_attention.GATE_UP_BLOCK or not fp32_cpu(x)):
        return None
    bias = None if gate.bias is None else interleave_rows(gate.bias, up.bias)
    return _product(type(gate), x, interleave_rows(gate.weight, up.weight), bias)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate_up = _fused_gate_up(self, x)
    if gate_up is not None:
        return self.down_proj(swiglu_fused(gate_up))
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


# The key-value cache an attention forward may be given, by transformers version; the forward below
# runs only without one (training, scoring) and leaves every call with one to transformers'.
_CACHES = ("cache", "past_key_value", "past_key_values")
# ... and the arguments besides the common ones such a forward may name (any other it passes on to
# the attention function in its **kwargs, as the forward below does)
_CACHE_ARGS = (*_CACHES, "cache_position")
# What each class passes its attention function besides the common arguments
_WINDOW = {
    "LlamaAttention": lambda m: {},
    "Qwen2Attention": lambda m: {"sliding_window": m.sliding_window},
    "Qwen3Attention": lambda m: {"sliding_window": m.sliding_window},
    "MistralAttention": lambda m: {"sliding_window": getattr(m.config, "sliding_window", None)},
}


def _fusable_attention(module: nn.Module) -> bool:
    """Whether ``_attention_forward`` stands in for this attention's forward: a class it knows whose
    forward takes (hidden_states, position_embeddings, attention_mask, cache arguments, **kwargs),
    with q, k and v projections ``_one_product`` takes (and Qwen3's q and k norms)."""
    name = type(module).__name__
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    named = [p for p in params if params[p].kind is not inspect.Parameter.VAR_KEYWORD]
    if (name not in _WINDOW or named[:4] != ["self", "hidden_states", "position_embeddings", "attention_mask"]
            or not set(named[4:]) <= set(_CACHE_ARGS) or len(named) == len(params)):
        return False
    if (name == "Qwen3Attention") != hasattr(module, "q_norm"):
        return False
    try:  # transformers versions whose forward worked its sliding window out otherwise keep their forward
        _WINDOW[name](module)
    except AttributeError:
        return False
    projections = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if not (all(isinstance(m, nn.Module) for m in projections) and _one_product(*projections)):
        return False
    module.hybridrl_named_cache_args = tuple(named[4:])  # what the class's forward takes out of **kwargs
    return True


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, *args,
                       **kwargs):
    """transformers' forward of the ``_WINDOW`` attentions without a cache, the q, k and v projections
    as one product on their concatenated weights (one input gradient backward instead of three and
    their sum); any call with a cache goes to the class's own forward."""
    q_proj, k_proj, v_proj = self.q_proj, self.k_proj, self.v_proj
    if (args or any(kwargs.get(n) is not None for n in _CACHES) or not fp32_cpu(hidden_states)
            or not _one_product(q_proj, k_proj, v_proj)):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in self.hybridrl_named_cache_args}
    bias = None if q_proj.bias is None else torch.cat([q_proj.bias, k_proj.bias, v_proj.bias])
    qkv = _product(type(q_proj), hidden_states, torch.cat([q_proj.weight, k_proj.weight, v_proj.weight]), bias)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = (t.view(hidden_shape) for t in qkv.split([q_proj.out_features, k_proj.out_features,
                                                        v_proj.out_features], -1))
    if hasattr(self, "q_norm"):
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    modeling = sys.modules[type(self).__module__]
    cos, sin = position_embeddings
    q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    implementation = self.config._attn_implementation
    functions = modeling.ALL_ATTENTION_FUNCTIONS
    if hasattr(functions, "get_interface"):
        attend = functions.get_interface(implementation, modeling.eager_attention_forward)
    else:
        attend = modeling.eager_attention_forward if implementation == "eager" else functions[implementation]
    out, weights = attend(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                          scaling=self.scaling, **_WINDOW[type(self).__name__](self), **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.variance_epsilon)


def use_cpu_layers(model: nn.Module) -> dict[str, int]:
    """Give each MLP of ``model`` whose class is one of ``FUSED_MLPS`` with a SiLU activation, and
    each norm of a ``FUSED_NORMS`` class, the forwards above (attributes of the modules: classes,
    parameters and state dicts stay as they are), and the attentions of ``ROPE_ATTENTIONS`` classes
    the rotary embedding's kernel and, where ``_fusable_attention``, the one-product q, k and v
    (``qkv``); returns how many of each. None where the kernels are unavailable.

    The rotary embedding is a function the attention's forward calls by its global name, so that
    name is what changes, in the modeling module (``transformers.models.qwen2.modeling_qwen2`` ...):
    for every model of that architecture in the process, fp32 CPU operands take the kernel, the
    same floats as transformers' eager ops; any other call goes on to transformers' function."""
    counts = {"mlp": 0, "norm": 0, "rope": 0, "qkv": 0}
    if not cpu_attention.available():
        return counts
    without_hub_kernels(model)  # else the norms lose these forwards at the first train() or eval()
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
            if _fusable_attention(module):
                module.forward = types.MethodType(_attention_forward, module)
                counts["qkv"] += 1
    return counts

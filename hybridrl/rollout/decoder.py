"""Forward passes that drive decoding: a compact one for Llama/Qwen2 and a generic HF one.

Both expose the same session interface used by the engine:
    prefill(input_ids, attention_mask, position_ids (N,P), repeats, max_new_tokens) -> logits (N,V)
    decode(tokens (b,), positions (b,)) -> logits (b,V)      one new token per active row
    select(keep (k,))                                          drop finished rows from the work
    free()                                                     release the KV cache

`CompactDecoder` runs the HF modules' own weights (norms and rotary modules are called as is, so
numerics follow HF) but fuses q/k/v and gate/up into single matmuls, keeps keys/values in a
preallocated `StaticKVCache`, and computes single-token attention per KV head group without
repeating keys. This removes most of HF's per-step Python and mask-building work.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from hybridrl.models.utils import SILU_CLASSES
from hybridrl.rollout import cpu_kernels
from hybridrl.rollout.kv_cache import StaticKVCache
from hybridrl.utils import cpu_matmul

COMPACT_MODEL_TYPES = ("llama", "qwen2")
# Rotary types whose frequencies do not depend on the sequence length (transformers' "dynamic" and
# "longrope" rescale them as the length grows): their cos / sin per position are tabulated once per
# rollout for the fused decode step instead of recomputed every step.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Decode steps of up to this many rows run their matmuls through the fused kernels' `dense` (one pass
# over the weights for all of them, reading overlapped with arithmetic); larger ones through MKL's
# packed GEMM, which is as fast once the arithmetic outweighs the reading (25M shapes, one thread, a
# CPU where MKL runs at full rate: 21.6 vs 24.6 ms at 48 rows, 24.1 vs 25.7 at 56, 27.2 vs 26.9 at 64), or where oneDNN is
# the CPU matmul backend (`hybridrl.utils.cpu_matmul`: AMD CPUs) through oneDNN, which the kernel still
# beats at 128 rows there (25M, Zen 5, one thread: 13.8 vs 17.4 ms at 64 rows, 27.6 vs 30.0 at 128;
# the tiny model 1.17 vs 1.24 ms at 128).
DENSE_KERNEL_MAX_ROWS = 64
DENSE_KERNEL_MAX_ROWS_ONEDNN = 128
# A prefill of up to this many tokens, ahead of decode steps on the kernels' `dense`, runs its products
# there too. Zen 5, one thread, GFLOP/s kernel / oneDNN: SmolLM2's shapes at 144 rows 209-223 / 193-209,
# the tiny model's at 224 rows 189-220 / 174-214; past about 1000 rows oneDNN is as fast or (inputs 128
# wide) 10-20% faster.
PREFILL_DENSE_MAX_TOKENS = 256


def supports_compact(model: PreTrainedModel) -> tuple[bool, str]:
    """Whether `CompactDecoder` reproduces this model exactly, and if not, why."""
    cfg = model.config
    if cfg.model_type not in COMPACT_MODEL_TYPES:
        return False, f"model_type {cfg.model_type!r} is not one of {COMPACT_MODEL_TYPES}"
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return False, "sliding-window attention layers are not supported by the compact path"
    layer = model.model.layers[0]
    if not hasattr(layer.self_attn, "q_proj") or not hasattr(layer.mlp, "gate_proj"):
        return False, "layer modules do not have the Llama q/k/v/o and gate/up/down projections"
    return True, ""


PRODUCTS = ("qkv", "o", "gate_up", "down")


@dataclass
class _FusedLayer:
    """One decoder layer's four products, q/k/v and gate/up each one product over their weights
    stacked along the output dimension.

    ``sources`` are the model's own (out, in) weights of each product. The kernels' packed layout is
    made from them directly (`CpuKernels.pack_weight` takes several), so a rollout whose products
    all run through the kernels never copies them; the single matrix the other products take
    (`weight`) is made on first use and kept until the next refresh. Two layouts for it
    (``out_in``). Packed decoding keeps nn.Linear's own (out, in) layout: MKL packs a contiguous
    (out, in) matrix about 4x faster than a transposed one, o/down are then the model's own tensors
    (no copy at all), and prefill's ``F.linear`` runs as fast as ``x @ W`` at prefill's row counts.
    Plain decoding takes contiguous (in, out) copies instead, because ``x @ W`` with a row-major
    (in, out) matrix ran up to ~1.5x faster than ``F.linear(x, W)`` for the skinny (32 x 576) decode
    matmuls on this CPU (MKL/oneDNN fp32, benchmarks/rollout_bench.py's setting).
    """

    sources: dict[str, list[torch.Tensor]]
    qkv_b: torch.Tensor | None
    o_b: torch.Tensor | None
    gate_up_b: torch.Tensor | None
    down_b: torch.Tensor | None
    out_in: bool  # `weight`'s layout: (out, in) (else (in, out))
    packed: dict[str, torch.Tensor] | None = None  # the four matrices packed for decode (see CompactDecoder)
    kernels: cpu_kernels.CpuKernels | None = None  # set when ``packed`` is in the fused kernels' layout
    joined: dict[str, torch.Tensor] = field(default_factory=dict)  # `weight`'s matrices made so far

    def out_features(self, name: str) -> int:
        return sum(w.shape[0] for w in self.sources[name])

    def weight(self, name: str) -> torch.Tensor:
        """The named product's matrix: the sources concatenated (a single (out, in) source is itself),
        in ``out_in``'s layout; made once per refresh."""
        matrix = self.joined.get(name)
        if matrix is None:
            matrix = self.joined[name] = _fuse(self.out_in, self.sources[name])
        return matrix

    def dense(self, name: str, x: torch.Tensor, rows: int) -> torch.Tensor:
        """x @ the named matrix (+ its bias); packed when ``rows`` (the products' row count) is set."""
        bias = getattr(self, name + "_b")
        if rows and self.kernels is not None:  # the kernels' layout: no joined matrix needed
            return _kernel_dense(self.kernels, x, self.packed[name], self.out_features(name), bias)
        return _dense(x, self.weight(name), bias, self.out_in, self.packed[name] if rows else None, rows)


def mkl_packing_supported(weight: torch.Tensor) -> bool:
    """Whether MKL's packed GEMM can run decode matmuls on this weight (fp32 on a CPU torch with MKL)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """An (out, in) weight in MKL's packed layout for products with exactly ``rows`` input rows."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)


def _kernel_dense(kernels: cpu_kernels.CpuKernels, x: torch.Tensor, packed: torch.Tensor, n: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) times a weight of ``n`` outputs packed by ``kernels.pack_weight``, + bias."""
    out = kernels.dense(x.reshape(-1, x.shape[-1]), packed, n, bias)
    return out.view(*x.shape[:-1], n)


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_in: bool,
           packed: torch.Tensor | None = None, rows: int = 0) -> torch.Tensor:
    """x (..., in) times ``weight`` ((out, in) if ``out_in``, else (in, out)) + bias; with ``packed``
    (``_pack(weight, rows)``, out_in layout) through MKL's packed GEMM, x's rows zero-padded up to
    ``rows`` (the products of the real rows are unchanged)."""
    flat = x.reshape(-1, x.shape[-1])
    if packed is not None:
        n = flat.shape[0]
        if n < rows:
            flat = F.pad(flat, (0, 0, 0, rows - n))
        out = torch.ops.mkl._mkl_linear(flat, packed, weight, bias, rows)[:n]
    elif out_in:
        out = cpu_matmul.linear(flat, weight, bias)  # oneDNN where it beats MKL (hybridrl.utils.cpu_matmul)
    else:
        out = torch.mm(flat, weight) if bias is None else torch.addmm(bias, flat, weight)
    return out.view(*x.shape[:-1], weight.shape[0] if out_in else weight.shape[1])


def _fuse(out_in: bool, weights: list[torch.Tensor]) -> torch.Tensor:
    """(out, in) weights concatenated along out, as a contiguous (out, in) or (in, out) matrix. A
    single (out, in) weight is the tensor itself, not a copy."""
    if out_in:
        return weights[0] if len(weights) == 1 else torch.cat(weights)
    return torch.cat(weights).t().contiguous()


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else lin.weight.new_zeros(lin.out_features) for b, lin in zip(biases, linears)])


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, for ``_rotate`` (made once per forward, not per layer)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF rotary embedding (rotate-half form) with the same values: x (b,t,h,D); cos and
    ``_signed_sin(sin)`` (b,t,1,D). HF multiplies ``cat(-x2, x1)`` by sin; here ``cat(x2, x1)`` by
    ``cat(-sin1, sin2)``, one negation less per layer, and (-a) * b == a * (-b) exactly in IEEE."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


# HF's RMSNorm classes for the compact architectures: pow(2).mean + eps, rsqrt, times the weight,
# the same operations as torch.rms_norm, which runs them in one call instead of about eight
_PLAIN_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm")


def kernels_unsupported(model: PreTrainedModel) -> str:
    """Why the fused CPU kernels cannot run this (compact-supported) model's decode step; "" if they can."""
    weight = model.lm_head.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"the fused kernels need fp32 CPU weights (got {weight.dtype} on {weight.device.type})"
    layers = model.model.layers
    norms = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)] + [model.model.norm]
    odd = {type(m).__name__ for m in norms} - set(_PLAIN_RMS_NORMS)
    if odd:
        return f"norm layers {sorted(odd)} are not HF's plain RMSNorm"
    if any(m.weight.dtype != torch.float32 for m in norms):
        return "norm weights are not fp32"
    act = type(layers[0].mlp.act_fn).__name__
    if act not in SILU_CLASSES:
        return f"activation {act} is not SiLU"
    attn = layers[0].self_attn
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    if attn.head_dim % 2 or groups > 64:
        return f"head_dim {attn.head_dim} is odd or {groups} query heads share a KV head (at most 64)"
    return ""


class CompactDecoder:
    """Llama/Qwen2 forward on a static KV cache (see module docstring).

    pack_weights: run decode-step matmuls (layers and LM head) on packed copies of the weights. A
        decode step multiplies a few dozen rows by every weight matrix, and plain ``mm`` reaches only
        about half the machine's matmul rate at that shape. Steps of up to DENSE_KERNEL_MAX_ROWS rows
        (DENSE_KERNEL_MAX_ROWS_ONEDNN where oneDNN is the CPU matmul backend) go through the fused
        kernels' ``dense`` (AVX-512 or AVX2 builds): its packing fits any row count, and
        it overlaps reading the weights with the arithmetic, which MKL's packed GEMM does not (SmolLM2
        at 32 rows, two threads: 35-54 vs 48-78 ms per step's matmuls). Larger steps, or no kernels:
        oneDNN's plain products where ``hybridrl.utils.cpu_matmul`` chose it (nothing packed), else
        MKL's packed GEMM with the weights packed for the step's row count (25-35% faster than plain
        ``mm``, bit-identical products), packed again when the live rows fall to half the packed
        count (rows are zero-padded up to it in between). Weights are packed at the first decode step
        after a weight update (a pass over the weights); the packed copy costs about the weights'
        size in memory and is released by ``free``. None: on where supported (fp32 on a CPU torch
        with MKL).
    fused_kernels: run a decode step's non-matmul work (residual adds and norms, rotary, cache
        write, attention, SiLU) as three fused C kernels per layer (`hybridrl.rollout.cpu_kernels`)
        instead of about forty torch ops. None: on where they apply (fp32 CPU weights, HF's plain
        RMSNorm and SiLU) and build (a C compiler; ``HYBRIDRL_CPU_KERNELS=0`` turns them off).
    """

    def __init__(self, model: PreTrainedModel, pack_weights: bool | None = None,
                 fused_kernels: bool | None = None, kv_cache_dtype: torch.dtype | None = None) -> None:
        ok, why = supports_compact(model)
        if not ok:
            raise ValueError(f"CompactDecoder cannot run {type(model).__name__}: {why}")
        supported = mkl_packing_supported(model.lm_head.weight)
        if pack_weights and not supported:
            raise ValueError("pack_weights=True needs fp32 weights on a CPU torch built with MKL")
        self.pack_weights = supported if pack_weights is None else pack_weights
        self.packed_rows = 0  # most rows the packed weights serve; 0: not packed
        self.packing: str | None = None  # "dense" (the fused kernels' layout), "mkl", or None
        self.packed_head: torch.Tensor | None = None
        self.model = model
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = model.config.num_attention_heads
        self.num_kv_heads = model.config.num_key_value_heads
        self.scaling = attn.scaling
        self.act = model.model.layers[0].mlp.act_fn
        self.layers: list[_FusedLayer] = []
        self.refresh_weights()
        param = next(model.parameters())
        self.kernels = self._load_kernels(fused_kernels)
        self.cache = StaticKVCache(len(self.layers), self.num_kv_heads, self.head_dim,
                                   self._cache_dtype(param.dtype, kv_cache_dtype))
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions, D) cos, signed sin
        # n > 1 samples per prompt with the fused kernels: one copy of each prompt's cache slots
        # (`StaticKVCache.share_prompts`); off, every sample gets its own copy (same numbers)
        self.share_prompts = True

    def _cache_dtype(self, model_dtype: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
        """The KV cache's dtype: the model's, or float16 for an fp32 model decoded by the fused kernels
        (`cpu_kernels.CpuKernels.decode_attention`: half the bytes for its attention to read)."""
        if wanted is None or wanted == model_dtype:
            return model_dtype
        if wanted != torch.float16 or model_dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype={wanted} with {model_dtype} weights: the cache takes the model's dtype, "
                             "or float16 for float32 weights")
        if self.kernels is None or not self.kernels.kv_half_supported:
            why = ("this build has no F16C conversions" if self.kernels is not None
                   else kernels_unsupported(self.model) or "the CPU kernels are off or could not be built")
            raise ValueError(f"kv_cache_dtype=float16 needs the native engine's fused CPU kernels: {why}")
        if self.head_dim > cpu_kernels.HALF_ROW:
            raise ValueError(f"kv_cache_dtype=float16 takes head sizes up to {cpu_kernels.HALF_ROW}; this model's is "
                             f"{self.head_dim}")
        return torch.float16

    def _load_kernels(self, wanted: bool | None) -> cpu_kernels.CpuKernels | None:
        why = kernels_unsupported(self.model)
        if wanted and why:
            raise ValueError(f"fused_kernels=True but {why}")
        if wanted is False or why:
            return None
        kernels = cpu_kernels.load()
        if wanted and kernels is None:
            raise ValueError("fused_kernels=True but the CPU kernels could not be built (see the warning above)")
        return kernels

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Rebuild the fused weights from the model's current parameters (after a weight update)."""
        self._drop_packed()
        self.layers = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            linears = {"qkv": (a.q_proj, a.k_proj, a.v_proj), "o": (a.o_proj,), "gate_up": (m.gate_proj, m.up_proj),
                       "down": (m.down_proj,)}
            self.layers.append(
                _FusedLayer(
                    sources={name: [lin.weight.detach() for lin in group] for name, group in linears.items()},
                    qkv_b=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                    o_b=a.o_proj.bias,
                    gate_up_b=_cat_bias(m.gate_proj, m.up_proj),
                    down_b=m.down_proj.bias,
                    out_in=self.pack_weights,
                )
            )

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        repeats: int,
        max_new_tokens: int,
    ) -> torch.Tensor:
        """Run the prompts (N,P), fill cache slots [0, P), then repeat or share (`share_prompts`) the rows
        G times; logits (N,V) at P-1."""
        rows, plen = input_ids.shape
        # the fused kernels read a prompt's slots from one copy for all its samples (`share_prompts`)
        share = self.share_prompts and self.kernels is not None and repeats > 1
        self.cache.allocate(rows, rows * repeats, plen + max_new_tokens, input_ids.device,
                            prompt_length=plen if share else 0)
        key_ok = attention_mask.bool()
        self.cache.prompt_valid()[:, :plen] = key_ok
        causal = torch.ones(plen, plen, dtype=torch.bool, device=input_ids.device).tril()
        # Pad queries (left padding) would see no key at all and give NaN: let them see themselves.
        mask = (causal & key_ok[:, None, :]) | torch.eye(plen, dtype=torch.bool, device=input_ids.device)
        # a prefill of a few hundred tokens whose decode starts on the kernels' `dense` runs its
        # products there too: packed once for both, no joined q/k/v or gate/up copies made
        limit, tokens = self._dense_limit(), rows * plen
        products = 0
        if tokens <= PREFILL_DENSE_MAX_TOKENS and rows * repeats <= limit:
            if self.packing != "dense":
                self._repack("dense", limit)
            products = tokens
        fused = self._prefill_fused(input_ids, position_ids, mask[:, None], products)
        hidden = fused if fused is not None else self._forward(input_ids, position_ids, mask[:, None], start=0,
                                                                 rows=products)
        self.cache.length = plen
        self.rope_table = None
        if self.kernels is not None and self.rope_tabulated:
            self.rope_table = self._rope_table(int(position_ids.max()) + max_new_tokens + 1, hidden)
        if share:
            self.cache.share_prompts(repeats)
        else:
            self.cache.repeat_rows(repeats)
        if fused is not None:  # already through the final norm
            return self._head(hidden[:, -1].contiguous())
        return self._logits(hidden[:, -1])

    def _prefill_fused(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                       rows: int) -> torch.Tensor | None:
        """The prefill's forward with its non-matmul work in hybridrl's kernels, as the decode step
        runs it: residual add and RMSNorm in one pass (`CpuKernels.add_rms_norm`), SiLU-and-multiply
        from the joined gate/up product (`CpuKernels.silu_mul`), the rotary embedding and the
        attention through the training kernels (`hybridrl.engine.cpu_attention`; the attention reads
        the keys in place and writes (b, t, heads, D), the o product's input, with no transpose).
        Returns the final-normed hidden states (b, t, E), or None where the kernels do not take the
        model's shapes (the torch ops of `_forward` then). Keys and values go to the cache at slot 0.

        SmolLM2, 32 prompts x 64 tokens, two threads (Zen 4): the torch ops around the products took
        about 0.33 of the prefill's 2.6 s (the attention 0.13, SiLU 0.06, norms and adds 0.07,
        the rotary embedding 0.07); this path took the prefill from 2.92 to 2.58 s (medians of 7,
        alternating). The rotary embedding of head sizes that are not a multiple of 32 runs as in
        `_forward`."""
        from hybridrl.engine import cpu_attention

        kernels, model = self.kernels, self.model.model
        if kernels is None or not cpu_attention.available():
            return None
        b, t = ids.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        probe = torch.empty(d).as_strided((b, hq + hkv, t, d), (0, 0, 0, 1))  # the operands' shape, no memory
        if not cpu_attention.usable(probe[:, :hq], probe[:, hq:], probe[:, hq:], mask):
            return None
        hidden = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(hidden, pos)
        if not cpu_attention.rope_usable(probe, cos, sin):  # (head sizes not a multiple of 32): torch's ops
            cos, sin = cos[:, :, None], _signed_sin(sin)[:, :, None]
        n, flat = b * t, hidden.view(b * t, -1)
        normed = torch.empty_like(flat)
        first = model.layers[0].input_layernorm
        kernels.add_rms_norm(flat, None, first.weight, first.variance_epsilon, normed, n)

        def attention(index: int, fused: _FusedLayer) -> torch.Tensor:
            qk, v = fused.dense("qkv", normed, rows).view(b, t, -1).split([(hq + hkv) * d, hkv * d], dim=-1)
            qk = qk.view(b, t, hq + hkv, d)
            if cos.dim() == 3:
                qk = cpu_attention.rope(qk.transpose(1, 2), cos, sin)
            else:
                qk = _rotate(qk, cos, sin).transpose(1, 2)
            q, k = qk.split([hq, hkv], dim=1)
            v = v.view(b, t, hkv, d).transpose(1, 2)
            self.cache.write(index, 0, k, v)
            return cpu_attention.attention(q, k, v, mask, self.scaling).view(n, hq * d)

        self._fused_layers(flat, normed, n, rows, attention)
        return normed.view(b, t, -1)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token per active row at the next slot; tokens/positions (b,); logits (b,V)."""
        start = self.cache.length
        self.cache.length += 1
        rows = self._packed_rows_for(tokens.shape[0])
        if self.kernels is not None:
            return self._decode_fused(tokens, positions, start, rows)
        hidden = self._forward(tokens[:, None], positions[:, None], self.cache.attention_mask(), start, rows)
        return self._logits(hidden[:, -1], rows)

    def _decode_fused(self, tokens: torch.Tensor, positions: torch.Tensor, start: int, rows: int) -> torch.Tensor:
        """`decode` through the fused kernels. Activations are kept at the matmuls' row count
        (``rows`` when packed) for the whole step, so no matmul pads or slices its input; the extra
        rows start as zeros, are never written by the kernels, and their products are dropped."""
        n, kernels, model = tokens.shape[0], self.kernels, self.model.model
        width = rows or n
        hidden = model.embed_tokens(tokens)
        if width > n:
            hidden = F.pad(hidden, (0, 0, 0, width - n))
        if self.rope_table is not None and int(positions.max()) < self.rope_table[0].shape[0]:
            cos, sin = (table.index_select(0, positions) for table in self.rope_table)
        else:
            cos, sin = model.rotary_emb(hidden, positions[:, None])
            cos, sin = cos[:, 0].contiguous(), _signed_sin(sin[:, 0]).contiguous()
        normed = hidden.new_zeros(hidden.shape)
        first = model.layers[0].input_layernorm
        kernels.add_rms_norm(hidden, None, first.weight, first.variance_epsilon, normed, n)
        if self.step_tables is not None:  # packed for `dense`: every layer in one call, the same arithmetic
            cache = self.cache
            kernels.decode_layers(hidden, normed, n, self.step_tables, cache.buffer,
                                  None if cache.source is None else cache.prompt_store, cache.source, cache.shared,
                                  cos, sin, cache.valid, start, self.num_heads, self.num_kv_heads, self.scaling)
            return self._head(normed, rows)[:n]
        attn = hidden.new_zeros(width, self.num_heads * self.head_dim)

        def attention(index: int, fused: _FusedLayer) -> torch.Tensor:
            keys, values = self.cache.layer(index)
            kernels.decode_attention(fused.dense("qkv", normed, rows), cos, sin, keys, values, self.cache.valid,
                                     start, attn, n, self.num_heads, self.num_kv_heads, self.scaling,
                                     self.cache.prompts(index), self.cache.source, self.cache.shared)
            return attn

        self._fused_layers(hidden, normed, n, rows, attention)
        return self._head(normed, rows)[:n]

    def _fused_layers(self, hidden: torch.Tensor, normed: torch.Tensor, n: int, rows: int, attention) -> None:
        """The layer loop of both fused paths (a decode step on per-layer calls, the prefill): on entry
        ``normed`` holds layer 0's input norm of ``hidden`` (both (W, E), ``n`` <= W rows live), on
        return the final norm's; per layer ``attention(index, fused)`` gives the attention's output
        (W, heads D) from ``normed``, then the o product with the residual add and the next norm, the
        gate/up product, SiLU-and-multiply and the down product with its residual add and norm run on
        the kernels. ``rows``: the products' packed row count (0: not packed)."""
        kernels, model = self.kernels, self.model.model
        act = hidden.new_zeros(hidden.shape[0], model.layers[0].mlp.down_proj.in_features)
        norms = [layer.input_layernorm for layer in model.layers[1:]] + [model.norm]  # each layer's next norm
        for index, (fused, layer) in enumerate(zip(self.layers, model.layers)):
            norm = layer.post_attention_layernorm
            kernels.add_rms_norm(hidden, fused.dense("o", attention(index, fused), rows), norm.weight,
                                 norm.variance_epsilon, normed, n)
            kernels.silu_mul(fused.dense("gate_up", normed, rows), act, n)
            norm = norms[index]
            kernels.add_rms_norm(hidden, fused.dense("down", act, rows), norm.weight, norm.variance_epsilon, normed, n)

    @property
    def rope_tabulated(self) -> bool:
        """Whether the model's rotary frequencies are fixed (``STATIC_ROPE_TYPES``), so that the cos /
        sin of every position can be computed once per rollout."""
        return getattr(self.model.model.rotary_emb, "rope_type", "default") in STATIC_ROPE_TYPES

    def _rope_table(self, positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``(positions, D)`` of positions 0 .. positions - 1, from the model's own
        rotary module: every value is computed element by element, so a row of the table equals what
        the module gives for that position in any batch (a decode step used to call it, and ten small
        ops around it, every step)."""
        pos = torch.arange(positions, device=like.device)[None]
        cos, sin = self.model.model.rotary_emb(like, pos)
        return cos[0].contiguous(), _signed_sin(sin[0]).contiguous()

    def select(self, keep: torch.Tensor) -> None:
        self.cache.select(keep)

    def free(self) -> None:
        self.cache.free()
        self._drop_packed()
        self.rope_table = None

    def _dense_limit(self) -> int:
        """Most rows a decode step runs through the kernels' `dense`; 0 where it does not run."""
        if not (self.pack_weights and self.kernels is not None and self.kernels.dense_supported):
            return 0
        return DENSE_KERNEL_MAX_ROWS_ONEDNN if cpu_matmul.backend() == "onednn" else DENSE_KERNEL_MAX_ROWS

    def _packed_rows_for(self, rows: int) -> int:
        """The matmuls' row count for a decode step of ``rows`` rows (packing first if needed): ``rows``
        itself with the fused kernels' packing, MKL's packed row count (rows are zero-padded up to
        it), or 0 for plain ``mm``."""
        if not self.pack_weights:
            return 0
        limit = self._dense_limit()
        if rows <= limit:
            if self.packing != "dense":
                self._repack("dense", limit)
            return rows
        if cpu_matmul.backend() == "onednn":  # oneDNN's plain product outruns MKL's packed one (about 2x on AMD)
            return 0
        if self.packing != "mkl" or rows > self.packed_rows or 2 * rows <= self.packed_rows:
            self._repack("mkl", rows)
        return self.packed_rows

    def _repack(self, packing: str, rows: int) -> None:
        """Pack the four layer matrices and the LM head: "dense" in the kernels' layout, straight from
        the model's weights (``rows`` is then the most rows a step runs through it), or "mkl" in MKL's
        for exactly ``rows`` rows, from the joined matrices."""
        self._drop_packed()  # the old packing goes first, so both never coexist in memory
        head = self.model.lm_head.weight.detach()
        if packing == "dense":
            kernels = self.kernels
            self.packed_head = kernels.pack_weight(head)
            for fused in self.layers:
                fused.packed = {name: kernels.pack_weight(*fused.sources[name]) for name in PRODUCTS}
                fused.kernels = kernels
            self.step_tables = self._step_tables()
        else:
            self.packed_head = _pack(head, rows)
            for fused in self.layers:
                fused.packed = {name: _pack(fused.weight(name), rows) for name in PRODUCTS}
        self.packing, self.packed_rows = packing, rows

    def _step_tables(self) -> cpu_kernels.DecodeTables:
        """`CpuKernels.decode_layers`'s tables for the layers packed for `dense`."""
        model = self.model.model
        layers = [dict(fused.packed, qkv_b=fused.qkv_b, o_b=fused.o_b, gate_up_b=fused.gate_up_b,
                       down_b=fused.down_b, qkv_width=fused.out_features("qkv"),
                       inter=fused.sources["down"][0].shape[1])
                  for fused in self.layers]
        norms = [model.layers[0].input_layernorm]
        for index, layer in enumerate(model.layers):
            norms += [layer.post_attention_layernorm,
                      model.layers[index + 1].input_layernorm if index + 1 < len(model.layers) else model.norm]
        return cpu_kernels.decode_tables(layers, [(norm.weight.detach(), norm.variance_epsilon) for norm in norms])

    def _drop_packed(self) -> None:
        for fused in getattr(self, "layers", ()):
            fused.packed, fused.kernels = None, None
        self.packed_head, self.packed_rows, self.packing = None, 0, None
        self.step_tables: cpu_kernels.DecodeTables | None = None  # set with the packing for `dense`

    def _logits(self, hidden: torch.Tensor, rows: int = 0) -> torch.Tensor:
        """Final norm, then the lm_head: (b, E) hidden states -> (b, V) logits."""
        return self._head(self._norm(self.model.model.norm, hidden), rows)

    def _head(self, normed: torch.Tensor, rows: int = 0) -> torch.Tensor:
        """lm_head of final-normed hidden states (b, E): packed when ``rows`` is set, else
        (V, E) @ (E, b) transposed back to (b, V).

        The head is the largest matrix of a small model (49152 x 576 for SmolLM2) and decode feeds
        it only b rows: `F.linear(x, W)` ran it ~1.5x slower on this CPU than `W @ x.T` (oneDNN
        picks a poor blocking for the skinny-times-wide case), with bit-identical results here
        (tests/rollout check greedy == HF `generate` and log-probs against the trainer).
        """
        head = self.model.lm_head
        if rows:  # packed: the (b, V) product comes out directly
            if self.packing == "dense":
                return _kernel_dense(self.kernels, normed, self.packed_head, head.weight.shape[0], head.bias)
            return _dense(normed, head.weight, head.bias, True, self.packed_head, rows)
        if cpu_matmul.uses_onednn(normed, head.weight, head.bias):
            return cpu_matmul.linear(normed, head.weight, head.bias)
        logits = torch.mm(head.weight, normed.t()).t().contiguous()
        return logits if head.bias is None else logits + head.bias

    @staticmethod
    def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)``; HF's plain fp32 RMSNorm through ``torch.rms_norm`` (bit-identical, fewer calls)."""
        if type(norm).__name__ in _PLAIN_RMS_NORMS and x.dtype == torch.float32 == norm.weight.dtype:
            return torch.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
        return norm(x)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, start: int, rows: int = 0) -> torch.Tensor:
        """Hidden states (b,t,E) before the final norm; writes each layer's keys/values at `start`.
        ``rows``: the packed row count for the matmuls (0: plain ``mm``)."""
        hidden = self.model.model.embed_tokens(ids)
        # the boolean mask as SDPA's additive one, made once here rather than inside every layer's call
        mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        cos, sin = self.model.model.rotary_emb(hidden, pos)
        sin = _signed_sin(sin)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (b,t,1,D): broadcast over heads, once per call
        for index, (fused, layer) in enumerate(zip(self.layers, self.model.model.layers)):
            attn_in = self._norm(layer.input_layernorm, hidden)
            hidden = hidden + self._attention(index, fused, attn_in, cos, sin, mask, start, rows)
            mlp_in = self._norm(layer.post_attention_layernorm, hidden)
            gate, up = fused.dense("gate_up", mlp_in, rows).chunk(2, dim=-1)
            # act(gate) * up formed in place: act's output (or, for an identity, gate's half of the
            # fresh matmul output) is read by nothing else; the values are those of act(gate) * up
            hidden = hidden + fused.dense("down", self.act(gate).mul_(up), rows)
        return hidden

    def _attention(self, index, fused, x, cos, sin, mask, start, rows) -> torch.Tensor:
        """Self-attention of x (b,t,E) over the cache; t > 1 is prefill (keys = x's own)."""
        b, t, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = fused.dense("qkv", x, rows).split([(hq + hkv) * d, hkv * d], dim=-1)
        # queries and keys rotated together: one set of rotary ops per layer instead of two
        q, k = _rotate(qk.view(b, t, hq + hkv, d), cos, sin).transpose(1, 2).split([hq, hkv], dim=1)
        v = v.view(b, t, hkv, d).transpose(1, 2)
        self.cache.write(index, start, k, v)
        if t > 1:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=hq != hkv)
            out = out.transpose(1, 2).reshape(b, t, hq * d)
        else:
            # One query per row: the G = hq/hkv query heads sharing a KV head (HF's repeat_kv order
            # puts them next to each other) become G "query positions" of that KV head.
            keys, values = self.cache.view(index)
            out = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), keys, values, attn_mask=mask, scale=self.scaling)
            out = out.reshape(b, 1, hq * d)
        return fused.dense("o", out, rows)


class HFDecoder:
    """Generic path: the HF model's own forward with a `DynamicCache` (any causal LM)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (b, filled slots) attention mask of the active rows
        # transformers >= 5.2x renamed `past_key_values` to `cache` (the old name warns, then goes).
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def refresh_weights(self) -> None:
        """Nothing is derived from the weights here."""

    def prefill(self, input_ids, attention_mask, position_ids, repeats, max_new_tokens) -> torch.Tensor:
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kwarg: self.cache},
        )
        self.cache.batch_repeat_interleave(repeats)
        self.mask = attention_mask.repeat_interleave(repeats, dim=0)
        return out.logits[:, -1]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=positions[:, None],
            use_cache=True,
            **{self.cache_kwarg: self.cache},
        )
        return out.logits[:, -1]

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.mask = self.mask[keep]

    def free(self) -> None:
        self.cache, self.mask = None, None

"""Fused fp32 CPU kernels for the compact decoder's decode step, compiled on first use.

``cpu_kernels.c`` holds three kernels for each layer (residual add + RMSNorm, SiLU-and-multiply,
and rotary + KV-cache write + single-token attention) that replace about forty small torch ops, one
for token selection (sampling or greedy, with the token's log-prob) that replaces about ten, and the
decode matmuls (`CpuKernels.dense`, AVX-512 or AVX2 builds) on weights packed once per weight update;
with those, `CpuKernels.decode_layers` runs all of a step's layers in one call. They
are compiled once per machine by ``hybridrl.utils.native_build`` (the C compiler on the PATH, into
``$HYBRIDRL_KERNEL_CACHE``) and loaded with ctypes. Where there is no compiler, or the build fails, `load` returns None (the reason
is logged once) and the decoder keeps its torch ops. ``HYBRIDRL_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
from pathlib import Path

import torch

from hybridrl.utils import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
HALF_ROW = 512  # largest head size a float16 cache takes (HR_HALF_ROW in cpu_kernels.c)
_SIGNATURES = {
    "hr_add_rms_norm": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT],
    "hr_silu_mul": [_PTR, _PTR, _I64, _I64, _INT],
    "hr_select_tokens": [_PTR, _PTR, _F32, _INT, _PTR, _PTR, _I64, _I64, _INT],
    "hr_pack_rows": [_PTR, _I64, _I64, _PTR, _I64, _INT],
    "hr_dense": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT, _INT],
    "hr_decode_attention": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR,
                            _I64, _I64, _I64, _I64, _F32, _PTR, _PTR, _I64, _I64, _PTR, _I64, _INT, _INT],
    "hr_decode_layers": [_PTR] * 7 + [_I64] * 6 + [_PTR] * 4 + [_I64] * 4 + [_PTR] + [_I64] * 4
                        + [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _INT, _INT, _INT],
}


STREAMS_ENV = "HYBRIDRL_DECODE_STREAMS"


def dense_streams(cpuinfo: str | None = None) -> int:
    """How many runs of panels `CpuKernels.dense` walks side by side (``streams`` of ``hr_dense``): 1,
    2 or 4, the same bits either way. ``HYBRIDRL_DECODE_STREAMS`` when set; else 2 on Intel CPUs,
    where one sequential stream of weight reads left the reads and the arithmetic hardly overlapping
    (SmolLM2's decode steps at 16 rows, one thread, on a Xeon: 55 -> 48 ms), and 1 elsewhere: on
    the AMD CPUs the kernel was tuned on, two streams are not measured. ``cpuinfo``: /proc/cpuinfo's
    text (read when None; where there is none, 1)."""
    value = os.environ.get(STREAMS_ENV, "").strip()
    if value:
        if value not in ("1", "2", "4"):
            raise ValueError(f"{STREAMS_ENV}={value!r}: expected 1, 2 or 4")
        return int(value)
    return 2 if native_build.cpu_fields(cpuinfo).get("vendor_id") == "GenuineIntel" else 1


@dataclasses.dataclass
class DecodeTables:
    """What `CpuKernels.decode_layers` reads per layer, as raw pointers: made once per packing of the
    weights (`decode_tables`), whose tensors it keeps alive."""

    layers: int
    qkv_width: int
    inter: int
    weights: torch.Tensor  # (L, 8) int64: packed qkv, bias, o, bias, gate_up, bias, down, bias (0: no bias)
    norms: torch.Tensor  # (L, 2) int64: post-attention norm weight, the next norm's weight
    eps: torch.Tensor  # (L, 2) float32: their epsilons
    keep: list  # the tensors pointed to


def decode_tables(layers: list[dict[str, torch.Tensor | None]], norms: list[tuple[torch.Tensor, float]]) -> DecodeTables:
    """Tables for `CpuKernels.decode_layers`: ``layers`` one dict per layer with the packed "qkv", "o",
    "gate_up", "down" and their biases "qkv_b" ... (None: no bias), plus "qkv_width" and "inter"
    (ints); ``norms`` the 2 L + 1 norms (weight, eps) in the order the step applies them: layer 0's
    input norm, then per layer its post-attention norm and the next one."""
    names = ("qkv", "qkv_b", "o", "o_b", "gate_up", "gate_up_b", "down", "down_b")
    keep = [t for layer in layers for t in (layer[name] for name in names) if t is not None]
    keep += [weight for weight, _ in norms]
    if len(norms) != 2 * len(layers) + 1 or len({(int(x["qkv_width"]), int(x["inter"])) for x in layers}) != 1:
        raise ValueError("decode_tables: layers of one shape and 2 L + 1 norms expected")
    if any(not t.is_contiguous() or t.dtype != torch.float32 or t.device.type != "cpu" for t in keep):
        raise ValueError("decode_tables: the packed weights, biases and norms must be contiguous fp32 CPU tensors")
    weights = torch.tensor([[0 if layer[name] is None else layer[name].data_ptr() for name in names]
                            for layer in layers], dtype=torch.int64)
    later = norms[1:]
    return DecodeTables(
        layers=len(layers), qkv_width=int(layers[0]["qkv_width"]), inter=int(layers[0]["inter"]), weights=weights,
        norms=torch.tensor([[w.data_ptr() for w, _ in later[2 * i: 2 * i + 2]] for i in range(len(layers))],
                           dtype=torch.int64),
        eps=torch.tensor([[e for _, e in later[2 * i: 2 * i + 2]] for i in range(len(layers))], dtype=torch.float32),
        keep=keep)


class CpuKernels:
    """The loaded kernels. They read raw pointers: every tensor given must be a contiguous fp32 CPU
    tensor of the documented shape (the decoder passes only tensors it made so; nothing is checked
    per call, which would cost more than some of the kernels)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        self._add_rms_norm = lib.hr_add_rms_norm
        self._silu_mul = lib.hr_silu_mul
        self._attention = lib.hr_decode_attention
        self._select_tokens = lib.hr_select_tokens
        self._pack_rows = lib.hr_pack_rows
        self._dense = lib.hr_dense
        self._decode_layers = lib.hr_decode_layers
        lib.hr_dense_supported.argtypes, lib.hr_dense_supported.restype = [], _INT
        lib.hr_packed_floats.argtypes, lib.hr_packed_floats.restype = [_I64, _I64], _I64
        self._packed_floats = lib.hr_packed_floats  # the layout's size is the C side's to say
        # the matmul kernel needs AVX-512 or AVX2 + FMA; builds without leave decode matmuls to torch
        self.dense_supported = bool(lib.hr_dense_supported())
        # a float16 KV cache (`kv_cache_dtype`): F16C conversions, which SIMD builds have on x86-64
        lib.hr_kv_half_supported.argtypes, lib.hr_kv_half_supported.restype = [], _INT
        self.kv_half_supported = bool(lib.hr_kv_half_supported())
        self.dense_streams = dense_streams()  # runs of panels `dense` reads side by side

    def add_rms_norm(self, hidden: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor, rows: int) -> None:
        """In place on the first ``rows`` rows: hidden += x (unless None); out = RMSNorm(hidden) * weight."""
        self._add_rms_norm(hidden.data_ptr(), None if x is None else x.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), rows, hidden.shape[-1], eps, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor, rows: int) -> None:
        """out[:rows] = silu(gate) * up, gate_up (R, 2I) holding gate then up."""
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, out.shape[-1], torch.get_num_threads())

    def decode_attention(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, valid: torch.Tensor, slot: int, out: torch.Tensor, rows: int,
                         heads: int, kv_heads: int, scale: float, prompts: tuple[torch.Tensor, torch.Tensor] | None = None,
                         source: torch.Tensor | None = None, shared: int = 0) -> None:
        """Rotary + cache write at ``slot`` + attention over slots [0, slot] for the first ``rows`` rows.

        qkv (R, (heads + 2 kv_heads) D); cos / signed_sin (rows, D); keys / values one layer's cache
        (max_rows, kv_heads, S, D) with the slot dimension contiguous per head; valid (max_rows, S)
        bool; out (R, heads D). Shared prompts: ``prompts`` = (keys, values) of the prompts (N,
        kv_heads, P, D), slot dimension contiguous per head, ``source`` (rows,) int64 each row's
        prompt, ``shared`` the slots [0, shared) read from it; the rows' own cache then holds slot
        s >= shared at index s - shared (``slot`` stays the absolute slot). The caches are float32, or
        all float16 where ``kv_half_supported``: the new key and value are stored rounded to float16 and
        the attention reads the rounded slots (exactly the float32 kernel on those values)."""
        d = cos.shape[-1]
        if prompts is None:
            pk = pv = src = None
            p_row = p_head = shared = 0
        else:
            if source is None or prompts[0].stride() != prompts[1].stride():
                raise ValueError("decode_attention: shared prompts need a source per row and keys/values alike")
            pk, pv, src = prompts[0].data_ptr(), prompts[1].data_ptr(), source.data_ptr()
            p_row, p_head = prompts[0].stride(0), prompts[0].stride(1)
        half = self._half(keys, values, *(prompts or ()))
        self._attention(qkv.data_ptr(), qkv.shape[-1], cos.data_ptr(), signed_sin.data_ptr(), keys.data_ptr(),
                        values.data_ptr(), keys.stride(0), keys.stride(1), valid.data_ptr(), valid.stride(0),
                        slot, slot + 1, out.data_ptr(), rows, heads, kv_heads, d, scale, pk, pv, p_row, p_head,
                        src, shared, half, torch.get_num_threads())

    def _half(self, *caches: torch.Tensor) -> int:
        """1 for float16 cache tensors (which this build must support), 0 for float32; anything else,
        or a mix, is refused before a kernel reads the memory with the wrong element size."""
        dtypes = {t.dtype for t in caches}
        if dtypes == {torch.float32}:
            return 0
        if dtypes != {torch.float16}:
            raise ValueError(f"KV cache tensors must all be float32 or all float16, got {sorted(map(str, dtypes))}")
        if not self.kv_half_supported:
            raise ValueError("a float16 KV cache needs F16C conversions, which this build of the CPU kernels lacks")
        if caches[0].shape[-1] > HALF_ROW:
            raise ValueError(f"a float16 KV cache takes head sizes up to {HALF_ROW}, got {caches[0].shape[-1]}")
        return 1

    def pack_weight(self, *weights: torch.Tensor) -> torch.Tensor:
        """Weights (n_i, k), stacked along n as ``torch.cat(weights)`` would be (q, k, v; gate, up),
        in `dense`'s layout: panels of 48 output columns, each (k, 48), zero-padded past the total n (a
        flat tensor of ceil(n / 48) * 48 * k floats). Each weight is packed at its column offset,
        with no concatenated copy."""
        k = weights[0].shape[1]
        if any(w.dim() != 2 or w.shape[1] != k or w.dtype != torch.float32 for w in weights):
            raise ValueError(f"pack_weight: fp32 (n, {k}) weights expected, got {[tuple(w.shape) for w in weights]}")
        n = sum(w.shape[0] for w in weights)
        packed = torch.empty(self._packed_floats(n, k), dtype=torch.float32)
        threads, col = torch.get_num_threads(), 0
        for weight in weights:
            weight = weight.detach().contiguous()
            self._pack_rows(weight.data_ptr(), weight.shape[0], k, packed.data_ptr(), col, threads)
            col += weight.shape[0]
        tail = packed.numel() // k - n  # columns of the last panel past n: zeros
        if tail:
            self._pack_rows(None, tail, k, packed.data_ptr(), n, threads)
        return packed

    def dense(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x (m, k) @ W.T + bias -> (m, n), W (n, k) given as ``pack_weight(W)``; the sum over k runs in
        blocks of 64 products (128 from 25 rows on), its error against float64 within 3x of torch's fp32
        matmul's or of a plain float32 sum in the same blocks, whichever is larger (tested: MKL on an
        Intel Xeon sums a few rows more accurately)."""
        m, k = x.shape
        x = x.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        self._dense(x.data_ptr(), m, k, packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
                    out.data_ptr(), self.dense_streams, torch.get_num_threads())
        return out

    def decode_layers(self, hidden: torch.Tensor, normed: torch.Tensor, rows: int, tables: DecodeTables,
                      cache: torch.Tensor, prompts: torch.Tensor | None, source: torch.Tensor | None, shared: int,
                      cos: torch.Tensor, signed_sin: torch.Tensor, valid: torch.Tensor, slot: int,
                      heads: int, kv_heads: int, scale: float) -> None:
        """All layers of a decode step in one call (``hr_decode_layers``): the products through `dense`
        on the packed weights in ``tables``, each layer's `decode_attention`, `add_rms_norm` and
        `silu_mul`, in the order and with the arguments the per-layer calls take, so the results are
        the same bits. ``hidden`` (W, E) is updated in place; ``normed`` (W, E) holds layer 0's input
        norm on entry and the final norm on return; ``rows`` <= W rows are live. ``cache`` is the
        KV cache's buffer (L, 2, max_rows, kv_heads, S, D), ``prompts`` the shared prompts' store
        (L, 2, N, kv_heads, P, D) with ``source`` and ``shared`` as for `decode_attention`, or None;
        both float32, or both float16 where ``kv_half_supported``."""
        width, embed = hidden.shape
        d = cos.shape[-1]
        qkv = hidden.new_empty(width, tables.qkv_width)
        attn = hidden.new_empty(width, heads * d)
        proj = hidden.new_empty(width, embed)
        gate_up = hidden.new_empty(width, 2 * tables.inter)
        act = hidden.new_empty(width, tables.inter)
        if prompts is None:
            p_ptr, p_layer, p_kv, p_row, p_head, src, shared = None, 0, 0, 0, 0, None, 0
        else:
            p_ptr, p_layer, p_kv, p_row, p_head = (prompts.data_ptr(), prompts.stride(0), prompts.stride(1),
                                                   prompts.stride(2), prompts.stride(3))
            src = source.data_ptr()
        self._decode_layers(hidden.data_ptr(), normed.data_ptr(), qkv.data_ptr(), attn.data_ptr(), proj.data_ptr(),
                            gate_up.data_ptr(), act.data_ptr(), rows, width, tables.layers, embed, tables.qkv_width,
                            tables.inter, tables.weights.data_ptr(), tables.norms.data_ptr(), tables.eps.data_ptr(),
                            cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
                            p_ptr, p_layer, p_kv, p_row, p_head, src, shared, cos.data_ptr(), signed_sin.data_ptr(),
                            valid.data_ptr(), valid.stride(0), slot, heads, kv_heads, d, scale,
                            self._half(cache, *(() if prompts is None else (prompts,))), self.dense_streams,
                            torch.get_num_threads())

    def select_tokens(self, logits: torch.Tensor, temperature: float, uniforms: torch.Tensor | None,
                      log_probs: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample (``uniforms`` (b,) in (0, 1]) or pick greedily (None) from logits (b, V) over the full
        vocabulary; tokens (b,) int64 and log_softmax(logits / temperature) at them (zeros unless
        ``log_probs``). See `hybridrl.rollout.sampling.select_tokens`."""
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.long)
        values = torch.zeros(rows, dtype=torch.float32)
        self._select_tokens(logits.data_ptr(), None if uniforms is None else uniforms.data_ptr(), temperature,
                            uniforms is not None, tokens.data_ptr(), values.data_ptr() if log_probs else None,
                            rows, vocab, torch.get_num_threads())
        return tokens, values


def build_and_load() -> CpuKernels:
    """Compile (or reuse) and load the kernels; raises with the compiler's message when that fails."""
    return CpuKernels(native_build.build_library(SOURCE, "the CPU decode kernels"))


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, or None when turned off (``HYBRIDRL_CPU_KERNELS=0``) or not buildable here."""
    if os.environ.get("HYBRIDRL_CPU_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    try:
        return build_and_load()
    except RuntimeError as exc:
        logger.warning("hybridrl: CPU decode kernels unavailable, decoding with torch ops: %s", exc)
        return None

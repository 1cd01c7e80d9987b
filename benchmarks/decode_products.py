"""The native decoder's matrix products for one decode step, weights from memory and from cache.

A decode step reads every weight once and does ``2 x rows`` FLOPs per weight, so at a few dozen rows
its products are bound by the memory read and the arithmetic at once, and how close a step comes to
``max(bytes / bandwidth, FLOPs / peak)`` depends on how well the two overlap (docs/performance.md,
"Decode products: the read and the arithmetic"). This times the products of one step through the
fused kernels' ``dense`` (``hybridrl/rollout/cpu_kernels.c``) on random weights of a model's shapes,
packed as the decoder packs them, two ways:

- ``memory``: every layer's own weights, as a real step reads them (far more than the caches hold);
- ``cache``: layer 0's weights for every layer, so the weights come from the caches and the time is
  about the arithmetic's alone;

and, at the same thread count, the machine's memory read rate and matmul peak (``floor.py``), which
give the two bounds. A step that overlapped perfectly would take the larger bound; one that did not
overlap at all would take the ``cache`` time plus the bytes over the bandwidth.

    python benchmarks/decode_products.py --model smollm2 --rows 16 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from hybridrl.rollout import cpu_kernels
from hybridrl.utils.malloc import keep_freed_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import cpu_description, measure_bandwidth, measure_peak_flops, provenance  # noqa: E402

PRODUCTS = ("qkv", "o", "gate_up", "down")


def model_config(name: str):
    """The HF config of ``smollm2`` (the prepared folder) or of a tiny preset (``tiny``, ``25m``, ...)."""
    if name == "smollm2":
        from transformers import AutoConfig

        from hybridrl.models.smollm2 import prepare_smollm2

        return AutoConfig.from_pretrained(prepare_smollm2())
    from hybridrl.models.tiny import tiny_config

    return tiny_config(preset=name)


def product_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each decoder-layer product as the decoder joins them (q-k-v, gate-up)."""
    embed, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or embed // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    return {"qkv": (embed, config.num_attention_heads * head_dim + 2 * kv),
            "o": (config.num_attention_heads * head_dim, embed), "gate_up": (embed, 2 * inter), "down": (inter, embed)}


def measure(config, rows: int, reps: int, seed: int = 0) -> dict:
    """Per-step seconds (median of ``reps``) of the products read from memory and from cache, the
    bytes and FLOPs of one step, and each product's share of a ``memory`` step."""
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.dense_supported:
        raise RuntimeError("the fused CPU kernels' dense products need an AVX-512 or AVX2 build of them")
    gen = torch.Generator().manual_seed(seed)
    shapes = product_shapes(config)
    vocab, embed = config.vocab_size, config.hidden_size

    def packed(k: int, n: int) -> tuple[torch.Tensor, int, int]:
        return kernels.pack_weight(torch.randn(n, k, generator=gen) * 0.02), n, k

    layers = [{name: packed(*shapes[name]) for name in PRODUCTS} for _ in range(config.num_hidden_layers)]
    head = packed(embed, vocab)
    inputs = {k: torch.randn(rows, k, generator=gen) for k, _ in shapes.values()}
    weight_floats = sum(n * k for layer in layers for _, n, k in layer.values()) + vocab * embed
    spent = dict.fromkeys((*PRODUCTS, "lm_head"), 0.0)

    def step(order, timed: bool = False) -> None:
        for layer in order:
            for name, (weight, n, k) in layer.items():
                start = time.perf_counter()
                kernels.dense(inputs[k], weight, n, None)
                if timed:
                    spent[name] += time.perf_counter() - start
        start = time.perf_counter()
        kernels.dense(inputs[embed], head[0], vocab, None)
        if timed:
            spent["lm_head"] += time.perf_counter() - start

    def seconds(order) -> float:
        for _ in range(2):
            step(order)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            step(order)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    from_memory = seconds(layers)
    # the LM head is read from memory either way (no cache holds it); the layers come from cache
    from_cache = seconds([layers[0]] * len(layers))
    step(layers, timed=True)
    return {"rows": rows, "memory_s": from_memory, "cache_s": from_cache, "bytes": 4 * weight_floats,
            "layer_bytes": 4 * (weight_floats - vocab * embed), "flops": 2 * rows * weight_floats,
            "products_s": spent}


def report(result: dict, bandwidth: float, peak: float) -> str:
    memory_bound, compute_bound = result["bytes"] / bandwidth, result["flops"] / peak
    # the cache run still reads the LM head from memory: its layers' share of the step is the arithmetic
    layer_reads = result["layer_bytes"] / bandwidth
    lines = [
        f"rows {result['rows']}: weights {result['bytes'] / 1e6:.0f} MB, {result['flops'] / 1e9:.2f} GFLOP a step",
        f"  from memory: {1e3 * result['memory_s']:.1f} ms a step, {result['bytes'] / result['memory_s'] / 1e9:.1f} GB/s,"
        f" {result['flops'] / result['memory_s'] / 1e9:.0f} GFLOP/s",
        f"  layers from cache: {1e3 * result['cache_s']:.1f} ms a step"
        f" ({result['flops'] / result['cache_s'] / 1e9:.0f} GFLOP/s)",
        f"  bounds: reading {1e3 * memory_bound:.1f} ms ({bandwidth / 1e9:.1f} GB/s), arithmetic"
        f" {1e3 * compute_bound:.1f} ms ({peak / 1e9:.0f} GFLOP/s); the step at"
        f" {100 * max(memory_bound, compute_bound) / result['memory_s']:.0f}% of the larger bound",
        f"  no overlap at all would take {1e3 * (result['cache_s'] + layer_reads):.1f} ms"
        f" (from cache + the layers' reading)",
        "  per product (ms, from memory): "
        + ", ".join(f"{name} {1e3 * s:.2f}" for name, s in result["products_s"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 or a tiny preset (tiny, 25m, ...)")
    parser.add_argument("--rows", default="16", help="rows per step, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=9, help="timed steps of each kind (their median)")
    parser.add_argument("--rates", choices=("on", "off"), default="on",
                        help="measure the memory read rate and matmul peak (off: report without bounds)")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as in a worker: the outputs' pages are not faulted in again every call
    torch.set_num_threads(args.threads)
    config = model_config(args.model)
    kernels = cpu_kernels.load()
    streams = kernels.dense_streams if kernels is not None else "-"
    print(f"{args.model} decode products, {args.threads} thread(s), {streams} stream(s) ({cpu_kernels.STREAMS_ENV}),"
          f" {cpu_description()} ({provenance()})")
    bandwidth = peak = None
    if args.rates == "on":
        bandwidth, peak = measure_bandwidth(), measure_peak_flops()
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        result = measure(config, rows, args.reps)
        results.append(result)
        if peak:
            print(report(result, bandwidth, peak), flush=True)
        else:
            print(f"rows {rows}: from memory {1e3 * result['memory_s']:.1f} ms, layers from cache"
                  f" {1e3 * result['cache_s']:.1f} ms a step", flush=True)
    return results


if __name__ == "__main__":
    main()

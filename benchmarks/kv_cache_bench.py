"""The native rollout with a float32 KV cache and with a float16 one, side by side in one process.

A decode step reads every live row's keys and values once per layer, and past a few hundred
positions that reading is a large part of the step (docs/rollout.md). ``kv_cache_dtype=float16``
stores an fp32 model's keys and values rounded to float16, half the bytes. This runs both caches
greedily on the same model and prompts with EOS suppressed (every row makes ``--new-tokens``
tokens), alternating run by run, and reports the medians, their ratio, how many rows produced the
same tokens, and how far the rollout's log-probs moved (over each row's tokens up to its first
difference, where both caches scored the same text).

    python benchmarks/kv_cache_bench.py --models smollm2 --batch 32 --new-tokens 512 --reps 2
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from hybridrl.rollout import NativeRolloutEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import cpu_description, provenance, results_dir  # noqa: E402
from rollout_bench import bench_prompts, load_models, rollout_parser  # noqa: E402

CACHES = {"float32": None, "float16": torch.float16}


def agreeing_prefix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, R) bool: positions before each row's first differing token."""
    return (a == b).long().cumprod(-1).bool()


def bench_model(name: str, model, args) -> dict:
    ids, mask, pos = bench_prompts(model, args)
    params = SamplingParams(do_sample=False, max_new_tokens=args.new_tokens, eos_token_id=None, logprobs=True)
    engines = {key: NativeRolloutEngine(model, kv_cache_dtype=dtype) for key, dtype in CACHES.items()}
    for engine in engines.values():  # warm up
        engine.generate_tensors(ids[:2], mask[:2], pos[:2], params.with_updates(max_new_tokens=4))
    times, outs = {key: [] for key in CACHES}, {}
    for rep in range(args.reps):
        for key, engine in engines.items():
            start = time.perf_counter()
            outs[key] = engine.generate_tensors(ids, mask, pos, params)
            times[key].append(time.perf_counter() - start)
        print(f"  {name} rep {rep}: " + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    for engine in engines.values():
        engine.free_cache()
    exact, half = outs["float32"], outs["float16"]
    same = agreeing_prefix(exact["responses"], half["responses"])
    drift = (exact["rollout_log_probs"] - half["rollout_log_probs"]).abs()[same]
    tokens = args.batch * args.new_tokens
    seconds = {key: statistics.median(v) for key, v in times.items()}
    return {
        "model": name,
        "tps": {key: tokens / s for key, s in seconds.items()},
        "speedup": seconds["float32"] / seconds["float16"],
        "rows_equal": int((exact["responses"] == half["responses"]).all(-1).sum()),
        "agreeing": float(same.float().mean()),
        "drift_max": float(drift.max()) if drift.numel() else float("nan"),
        "drift_mean": float(drift.mean()) if drift.numel() else float("nan"),
    }


def to_markdown(rows: list[dict], args) -> str:
    head = (f"Native rollout, float32 vs float16 KV cache (`actor_rollout_ref.rollout.kv_cache_dtype`), greedy, "
            f"batch {args.batch} x {args.new_tokens} new tokens, prompt {args.prompt_len}, fp32 weights, "
            f"{torch.get_num_threads()} threads, median of {args.reps} alternating runs, on {cpu_description()} "
            f"({provenance()}).\n\n"
            "| model | float32 cache tok/s | float16 cache tok/s | speedup | greedy rows equal | tokens before a row's "
            "first difference | log-prob drift there, max / mean |\n|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['model']} | {r['tps']['float32']:.0f} | {r['tps']['float16']:.0f} | {r['speedup']:.2f}x "
             f"| {r['rows_equal']}/{args.batch} | {100 * r['agreeing']:.1f}% "
             f"| {r['drift_max']:.2e} / {r['drift_mean']:.2e} |" for r in rows]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = rollout_parser(__doc__, new_tokens=512, out=results_dir() / "kv_cache.md")
    parser.set_defaults(models="smollm2", reps=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    provenance()  # the code as the run starts (floor.provenance)
    rows = [bench_model(name, model, args) for name, model in load_models(args.models.split(","))]
    text = "# KV cache dtype\n\n" + to_markdown(rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

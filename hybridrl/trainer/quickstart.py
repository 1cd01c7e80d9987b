"""``make quickstart`` / ``hybridrl quickstart``: the whole pipeline on the built-in tiny model.

1. data: the built-in digit-reversal task ("reverse 52817" -> "71825", 3 to 8 digits) in verl's
   parquet schema, with held-out test prompts;
2. model: the built-in tiny Qwen2 (0.7M parameters) and its tokenizer, made offline;
3. a short SFT warm start (``main_sft``): the model learns the answer format and gets the short
   strings right, the long ones mostly wrong;
4. GRPO (``main_ppo``) on 2 Ray worker ranks (FSDP2 over gloo), validated on the held-out prompts
   by sampling 4 responses each at the training temperature (mean@4: the expected reward that RL
   maximises, measured on prompts it never trained on).

Everything lands under ``--out`` (default ``outputs/quickstart``); the summary at the end says where
the metrics and checkpoints went and how the validation score moved.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TASK, SOURCE = "reverse", "hybridrl/reverse"
VAL_PREFIX = f"val-core/{SOURCE}/"


def prepare_assets(out: Path) -> tuple[Path, Path]:
    from hybridrl.data.preprocess import prepare
    from hybridrl.models import make_tiny_model_dir

    data_dir = out / "data"
    if not (data_dir / "test.parquet").exists():
        prepare(TASK, data_dir, n=20000, n_test=128, seed=0, min_len=3, max_len=8)
    return data_dir, make_tiny_model_dir(out / "tiny_model", preset="tiny")


def run_sft_stage(out: Path, data_dir: Path, model_dir: Path, steps: int) -> Path:
    from hybridrl.config.sft_schema import load_sft_config
    from hybridrl.trainer.main_sft import run_sft

    run_dir = out / "sft"
    if (run_dir / "hf_model" / "config.json").exists():
        print(f"quickstart: SFT model exists, reusing {run_dir / 'hf_model'}", flush=True)
        return run_dir / "hf_model"
    overrides = [f"data.train_files=[{data_dir / 'train.parquet'}]", f"data.val_files=[{data_dir / 'test.parquet'}]",
                 f"model.partial_pretrain={model_dir}", f"trainer.default_local_dir={run_dir}",
                 f"trainer.total_training_steps={steps}", "trainer.logger=[file]", f"trainer.test_freq={steps}",
                 "trainer.resume_mode=disable", "optim.lr=1e-3", "trainer.val_generation_length=12"]
    run_sft(load_sft_config(overrides, preset="sft_quickstart"))
    return run_dir / "hf_model"


def run_grpo_stage(out: Path, data_dir: Path, model_dir: Path, steps: int, workers: int, extra: list[str]) -> Path:
    from hybridrl.config import load_config
    from hybridrl.trainer.main_ppo import run

    run_dir = out / "grpo"
    overrides = [f"data.train_files=[{data_dir / 'train.parquet'}]", f"data.val_files=[{data_dir / 'test.parquet'}]",
                 f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={run_dir}",
                 f"trainer.total_training_steps={steps}", f"trainer.n_cpu_workers={workers}",
                 "trainer.resume_mode=disable", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                 "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.n=4",
                 "trainer.save_freq=50", *extra]
    run(load_config(overrides, preset="grpo_quickstart"))
    return run_dir


def greedy_accuracy(model: Path, test_file: Path, out: Path) -> float:
    """Greedy exact-match accuracy on the held-out prompts, with ``hybridrl eval``."""
    from hybridrl.trainer import evaluate

    evaluate.main(["--model", str(model), "--data", str(test_file), "--n", "1", "--temperature", "0",
                   "--max-new-tokens", "12", "--out", str(out)])
    return json.loads((out / "results.json").read_text())["metrics"][SOURCE]["strict/mean@1"]


def summarize(grpo_dir: Path, seconds: float, greedy: dict[str, float]) -> dict[str, float]:
    records: dict[int, dict] = {}
    for line in (grpo_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        records[rec["step"]] = rec
    val_key = next(k for rec in records.values() for k in rec if k.startswith(VAL_PREFIX))
    val = {step: rec[val_key] for step, rec in sorted(records.items()) if val_key in rec}
    first, last = min(val), max(val)
    train = [rec["critic/score/mean"] for _, rec in sorted(records.items()) if "critic/score/mean" in rec]
    print("\n=== hybridrl quickstart ===")
    print(f"validation accuracy on held-out prompts, 4 samples each at temperature 1 ({val_key}):")
    for step, acc in val.items():
        print(f"  step {step:>3}: {acc:.3f}")
    print(f"training score (critic/score/mean): first step {train[0]:.3f} -> last step {train[-1]:.3f}")
    print(f"greedy accuracy on held-out prompts: after SFT {greedy['sft']:.3f} -> after RL {greedy['grpo']:.3f}")
    print(f"metrics:     {grpo_dir / 'metrics.jsonl'}")
    print(f"checkpoints: {grpo_dir} (global_step_*/)")
    print(f"wall time:   {seconds / 60:.1f} min")
    return {"val_before": val[first], "val_after": val[last], **greedy}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridrl quickstart", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/quickstart", help="folder for data, models and runs")
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--grpo-steps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2, help="Ray worker ranks (FSDP2 over gloo)")
    parser.add_argument("overrides", nargs="*", help="extra main_ppo overrides for the GRPO stage (key=value)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out).expanduser().resolve()
    data_dir, tiny = prepare_assets(out)
    sft_model = run_sft_stage(out, data_dir, tiny, args.sft_steps)
    grpo_dir = run_grpo_stage(out, data_dir, sft_model, args.grpo_steps, args.workers, args.overrides)
    test_file = data_dir / "test.parquet"
    last = max(grpo_dir.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    greedy = {"sft": greedy_accuracy(sft_model, test_file, out / "eval_sft"),
              "grpo": greedy_accuracy(last, test_file, out / "eval_grpo")}
    summarize(grpo_dir, time.perf_counter() - start, greedy)
    return 0

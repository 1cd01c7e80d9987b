"""Soak: many GRPO steps on the tiny model; resident memory and Ray's object store must stay flat.

Runs the real trainer (Ray worker group, FSDP2 over gloo, reward worker processes, checkpoints
rotated by ``max_actor_ckpt_to_keep``, validation) and after every step samples

- the RSS of the driver, of each worker rank, and of the whole process tree the run started
  (driver + Ray's gcs/raylet + workers + reward processes),
- what the driver keeps alive in Ray (object references, in-process store bytes) and the raylet's
  RSS (Ray's shared-memory object store is mapped there).

Growth is reported as a least-squares slope over the steps after the warm-up (MiB per 100 steps)
and as the difference between the mean of the first and the last 10% of post-warm-up samples.

    python benchmarks/soak.py                          # 200 steps, 2 ranks
    python benchmarks/soak.py --steps 50 --warmup 10   # quicker look

Writes benchmarks/results/soak.json (every sample) and prints the summary. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
MiB = float(1 << 20)


def rss_bytes(pid: int) -> float:
    """Resident set size of one process (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024.0
    except OSError:
        return 0.0
    return 0.0


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (from /proc/<pid>/stat parent links)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def ray_store() -> dict:
    """What the driver keeps alive in Ray: referenced objects and its in-process store's bytes.

    (Ray's plasma store lives in the raylet process: its pages are counted in ``raylet_rss``.
    ``ray.internal_api.memory_summary`` would give plasma totals but needs grpcio, not installed.)
    """
    import ray

    core = ray._private.worker.global_worker.core_worker
    return {"ray_refs": len(core.get_all_reference_counts()), "ray_local_store_bytes": float(core.get_local_memory_store_bytes_used())}


def raylet_rss(tree: list[int]) -> float:
    for pid in tree:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                return rss_bytes(pid)
        except OSError:
            continue
    return 0.0


def build(args, root: Path):
    """Assets, config and the trainer, assembled as ``hybridrl.trainer.main_ppo.run`` does."""
    from hybridrl.config import load_config
    from hybridrl.data.preprocess import prepare
    from hybridrl.models import load_tokenizer, make_tiny_model_dir
    from hybridrl.trainer.main_ppo import build_loaders, build_reward_manager
    from hybridrl.trainer.ppo_trainer import PPOTrainer
    from hybridrl.trainer.tracking import Tracking
    from hybridrl.trainer.workers import PPOWorkers

    data = prepare("addition", root / "data", n=256, n_test=8, seed=0, max_digits=2)
    model = make_tiny_model_dir(root / "model", preset="tiny")
    overrides = {
        "data.train_files": f"[{data['train']}]", "data.val_files": f"[{data['test']}]",
        "data.train_batch_size": 4, "data.max_response_length": 16, "data.max_prompt_length": 32,
        "data.val_batch_size": 8, "actor_rollout_ref.model.path": str(model), "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "trainer.total_training_steps": args.steps, "trainer.test_freq": args.save_freq,
        "trainer.save_freq": args.save_freq, "trainer.max_actor_ckpt_to_keep": 2, "trainer.logger": "[file]",
        "trainer.default_local_dir": str(root / "run"), "trainer.n_cpu_workers": args.workers,
        "trainer.val_before_train": False, "reward.num_workers": 1,
    }
    config = load_config([f"{k}={v}" for k, v in overrides.items()], preset="grpo_quickstart")
    tokenizer = load_tokenizer(str(model))
    train, val = build_loaders(config, tokenizer)
    workers = PPOWorkers(config, args.steps)
    tracking = Tracking(config.trainer.logger, root / "run", "soak", "soak", {})
    trainer = PPOTrainer(config, workers, train, val, build_reward_manager(config, tokenizer),
                         build_reward_manager(config, tokenizer, for_validation=True), tracking, root / "run")
    return trainer, workers, tracking


def sample(step: int, workers, start: float) -> dict:
    pids, tree = workers.group.worker_pids(), process_tree(os.getpid())
    return {"step": step, "time_s": time.monotonic() - start, "driver_rss": rss_bytes(os.getpid()),
            "worker_rss": [rss_bytes(p) for p in pids], "tree_rss": sum(rss_bytes(p) for p in tree),
            "raylet_rss": raylet_rss(tree), **ray_store()}


def soak(args) -> list[dict]:
    """Drive ``fit`` step by step (same stages, same order) and sample after each step."""
    with tempfile.TemporaryDirectory(prefix="hybridrl-soak-") as tmp:
        trainer, workers, tracking = build(args, Path(tmp))
        samples, start = [], time.monotonic()
        try:
            trainer._resume()
            while trainer.global_step < trainer.total_steps:
                trainer.global_step += 1
                metrics = trainer.train_step()
                is_last = trainer.global_step == trainer.total_steps
                if trainer.global_step % args.save_freq == 0 or is_last:
                    metrics.update(trainer.validate())
                    trainer.save_checkpoint()
                tracking.log(metrics, step=trainer.global_step)
                samples.append(sample(trainer.global_step, workers, start))
                if trainer.global_step % 10 == 0:
                    s = samples[-1]
                    print(f"step {s['step']}: tree {s['tree_rss'] / MiB:.0f} MiB, driver {s['driver_rss'] / MiB:.0f}, "
                          f"workers {[round(w / MiB) for w in s['worker_rss']]}, raylet {s['raylet_rss'] / MiB:.0f}, "
                          f"ray refs {s['ray_refs']}, {s['time_s']:.0f} s", flush=True)
        finally:
            workers.shutdown()
            tracking.close()
            trainer.reward_fn.close()
            trainer.val_reward_fn.close()
    return samples


def growth(samples: list[dict], key, warmup: int) -> dict:
    """Slope (MiB / 100 steps) and first-vs-last-10% difference (MiB) after the warm-up."""
    rows = [s for s in samples if s["step"] > warmup]
    steps = np.array([s["step"] for s in rows], dtype=float)
    values = np.array([key(s) for s in rows], dtype=float) / MiB
    k = max(1, len(rows) // 10)
    slope = float(np.polyfit(steps, values, 1)[0] * 100) if len(rows) > 1 else 0.0
    return {"start_mib": float(values[:k].mean()), "end_mib": float(values[-k:].mean()),
            "delta_mib": float(values[-k:].mean() - values[:k].mean()), "slope_mib_per_100_steps": slope}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--save-freq", type=int, default=50)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    samples = soak(args)
    summary = {
        "tree_rss": growth(samples, lambda s: s["tree_rss"], args.warmup),
        "driver_rss": growth(samples, lambda s: s["driver_rss"], args.warmup),
        "worker_rss_max": growth(samples, lambda s: max(s["worker_rss"]), args.warmup),
        "raylet_rss": growth(samples, lambda s: s["raylet_rss"], args.warmup),
        "ray_local_store": growth(samples, lambda s: s["ray_local_store_bytes"], args.warmup),
        "ray_refs": {"after_warmup": samples[min(args.warmup, len(samples) - 1)]["ray_refs"],
                     "end": samples[-1]["ray_refs"], "max": max(s["ray_refs"] for s in samples)},
        "steps": args.steps, "workers": args.workers, "wall_s": samples[-1]["time_s"],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

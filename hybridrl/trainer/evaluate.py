"""``hybridrl eval``: generate on a verl-format parquet and report accuracy per data source.

    hybridrl eval --model <HF folder | checkpoint dir> --data test.parquet [--n 4] [--temperature 1.0]
                  [--max-new-tokens 256] [--batch-size 32] [--limit K] [--out DIR]

A checkpoint dir (``global_step_N`` or ``global_step_N/actor``) is merged into a temporary Hugging
Face folder first (``hybridrl.model_merger``). Generation uses the native rollout engine: greedy
when ``--temperature 0`` (the default with ``--n 1``), otherwise sampling with ``--seed``.

Reports per data source (and ``all``): ``strict|lenient/{mean,maj,best}@N``, ``format/mean@N``
where the source has an answer format, response length and clip ratio (see
``hybridrl.trainer.eval_metrics``). Writes ``<out>/results.json`` and ``<out>/samples.jsonl``
(prompt, response, scores, answer of every sample).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridrl.data.dataset import RLHFDataset, collate_prompts
from hybridrl.model_merger import find_checkpoint_dir, is_engine_checkpoint, merge_checkpoint
from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.rewards import load_reward_function
from hybridrl.rollout.base import SamplingParams, eos_ids
from hybridrl.rollout.native import NativeRolloutEngine
from hybridrl.trainer.dumps import write_jsonl
from hybridrl.trainer.eval_metrics import SampleRecord, aggregate, format_table, score_response

GEN_KEYS = ("input_ids", "attention_mask", "position_ids")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridrl eval", description="evaluate a model on a verl-format parquet")
    p.add_argument("--model", required=True, help="Hugging Face folder, or a checkpoint global_step_N[/actor]")
    p.add_argument("--data", required=True, nargs="+", help="parquet / JSONL file(s) in verl's row format")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (N of mean@N, maj@N, best@N)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; default 0 if n == 1 else 1.0")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length R")
    p.add_argument("--max-prompt-length", type=int, default=1024, help="P; longer prompts keep their last P tokens")
    p.add_argument("--batch-size", type=int, default=32, help="prompts generated together")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first K prompts")
    p.add_argument("--out", default="eval_output", help="folder for results.json and samples.jsonl")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--reward-fn-key", default="data_source", help="column naming the data source")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    p.add_argument("--reward-function", default=None, metavar="FILE.py[:NAME]",
                   help="custom reward function (verl signature) scoring every source; NAME defaults to compute_score")
    return p


@contextlib.contextmanager
def model_folder(path: str | Path) -> Iterator[Path]:
    """A Hugging Face folder for ``path``: itself, or a temporary merge of a checkpoint (removed after)."""
    path = Path(path)
    if (path / "config.json").is_file():
        yield path
        return
    if not (is_engine_checkpoint(path) or is_engine_checkpoint(path / "actor")):
        raise FileNotFoundError(f"--model {path}: neither a Hugging Face folder (config.json) nor a checkpoint "
                                "(global_step_N or global_step_N/actor with model_optim/)")
    with tempfile.TemporaryDirectory(prefix="hybridrl-eval-merged-") as tmp:
        yield merge_checkpoint(find_checkpoint_dir(path), Path(tmp) / "model")


def sampling_params(args: argparse.Namespace, tokenizer, model) -> SamplingParams:
    temperature = args.temperature if args.temperature is not None else (0.0 if args.n == 1 else 1.0)
    return SamplingParams(n=args.n, temperature=temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                          do_sample=temperature > 0, eos_token_id=eos_ids(tokenizer, getattr(model, "generation_config", None)),
                          pad_token_id=tokenizer.pad_token_id, seed=args.seed, logprobs=False)


def _custom_reward(spec: str | None):
    if spec is None:
        return None
    path, _, name = spec.partition(":")
    return load_reward_function(path, name or "compute_score")


def generate_batch(engine: NativeRolloutEngine, tokenizer, items: list[dict], params: SamplingParams
                   ) -> tuple[list[str], list[int], list[bool]]:
    """Responses of ``len(items) * n`` rows (sample g of item i is row i*n+g): texts (special tokens
    skipped), lengths, and whether each was cut at ``max_new_tokens`` without a stop token."""
    prompts = collate_prompts(items).select(batch_keys=list(GEN_KEYS), non_tensor_batch_keys=[])
    out = engine.generate(prompts, params)  # the engine skips all-padding prompt columns itself
    responses = out.batch["responses"]
    lengths = out.batch["response_mask"].sum(-1).tolist()
    stops = torch.tensor(params.stop_ids, dtype=responses.dtype)
    ends_stopped = torch.isin(responses[:, -1], stops).tolist()
    texts = tokenizer.batch_decode([row[: int(n)].tolist() for row, n in zip(responses, lengths)],
                                   skip_special_tokens=True)
    clipped = [int(n) == params.max_new_tokens and not s for n, s in zip(lengths, ends_stopped)]
    return texts, [int(n) for n in lengths], clipped


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the evaluation described by the parsed ``args``; returns the results dict (also written)."""
    custom_fn = _custom_reward(args.reward_function)
    with model_folder(args.model) as folder:
        tokenizer = load_tokenizer(args.tokenizer or folder)
        model = load_causal_lm(folder)
        dataset = RLHFDataset(args.data, tokenizer, max_prompt_length=args.max_prompt_length, prompt_key=args.prompt_key,
                              truncation="left", return_full_prompt=True,
                              required_columns=(args.reward_fn_key, "reward_model"))
        params = sampling_params(args, tokenizer, model)
        engine = NativeRolloutEngine(model, max_num_seqs=max(1, args.batch_size * args.n))
        count = len(dataset) if args.limit is None else min(args.limit, len(dataset))
        records, samples = [], []
        for start in range(0, count, args.batch_size):
            items = dataset.__getitems__(list(range(start, min(start + args.batch_size, count))))
            # row b of a call draws from (seed, b): a fresh seed per batch keeps batches independent
            batch_seed = int(np.random.SeedSequence([args.seed, start]).generate_state(1)[0])
            texts, lengths, clipped = generate_batch(engine, tokenizer, items, params.with_updates(seed=batch_seed))
            for row, (text, length, cut) in enumerate(zip(texts, lengths, clipped)):
                item, prompt_id = items[row // args.n], start + row // args.n
                record, sample = _score_row(args, item, prompt_id, row % args.n, text, length, cut, custom_fn)
                records.append(record)
                samples.append(sample)
    return _write_results(args, params, aggregate(records, args.n), samples)


def _score_row(args, item: dict, prompt_id: int, sample_index: int, text: str, length: int, clipped: bool,
               custom_fn) -> tuple[SampleRecord, dict[str, Any]]:
    source = str(item[args.reward_fn_key])
    truth = item["reward_model"]["ground_truth"]
    score = score_response(source, text, truth, item.get("extra_info"), custom_fn)
    record = SampleRecord(prompt_id, source, score, length, clipped)
    sample = {"index": prompt_id, "sample": sample_index, "data_source": source, "prompt": item["full_prompts"],
              "response": text, "ground_truth": truth, "score": score.strict, "lenient": score.lenient,
              "answer": score.strict_answer, "format": score.formatted, "length": length, "clipped": clipped}
    return record, sample


def _write_results(args, params: SamplingParams, metrics: dict, samples: list[dict]) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "model": str(args.model),
        "data": [str(d) for d in args.data],
        "sampling": {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
                     "max_new_tokens": params.max_new_tokens, "greedy": params.greedy, "seed": params.seed},
        "metrics": metrics,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_jsonl(out / "samples.jsonl", samples)
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.n < 1 or args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        print(f"hybridrl eval: --n, --batch-size and --limit must be >= 1 (got {args.n}, {args.batch_size}, "
              f"{args.limit})", file=sys.stderr)
        return 2
    try:
        results = evaluate(args)
    except (FileNotFoundError, NotImplementedError, ValueError) as err:
        print(f"hybridrl eval: {err}", file=sys.stderr)
        return 2
    print(format_table(results["metrics"]))
    print(f"\nwrote {Path(args.out) / 'results.json'} and {Path(args.out) / 'samples.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

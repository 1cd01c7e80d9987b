"""``python -m hybridrl.model_merger {merge,test}`` (verl's model_merger flags, FSDP backend only).

    merge --local_dir <ckpt>/global_step_N/actor --target_dir <out> [--hf_model_path DIR] [--dtype bfloat16]
    test  --local_dir <ckpt>/global_step_N/actor --test_hf_dir <ref> [--rtol R] [--atol A]

``test`` exits 1 and lists every mismatching tensor when the checkpoint and the reference differ.
"""

from __future__ import annotations

import argparse
import sys

from hybridrl.model_merger.core import (
    checkpoint_summary,
    compare_with_reference,
    find_checkpoint_dir,
    merge_checkpoint,
)

MAX_LISTED = 50


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.model_merger", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("merge", "write a Hugging Face folder"), ("test", "compare with a reference folder")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--backend", default="fsdp", choices=["fsdp"],
                       help="checkpoint format (verl flag; hybridrl writes FSDP2/DCP checkpoints only)")
        p.add_argument("--local_dir", "--local-dir", required=True,
                       help="<default_local_dir>/global_step_N/actor (or /critic, or global_step_N for the actor)")
        p.add_argument("--hf_model_path", "--hf-model-path", default=None,
                       help="folder with config.json (+ tokenizer) when the checkpoint has no huggingface/")
        if name == "merge":
            p.add_argument("--target_dir", "--target-dir", required=True, help="output Hugging Face folder")
            p.add_argument("--dtype", default=None, help="cast weights: float32 | bfloat16 | float16 (default: as stored)")
        else:
            p.add_argument("--test_hf_dir", "--test-hf-dir", required=True, help="reference Hugging Face folder")
            p.add_argument("--rtol", type=float, default=1e-5)
            p.add_argument("--atol", type=float, default=1e-6)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _run(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"model_merger: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    ckpt = find_checkpoint_dir(args.local_dir)
    summary = checkpoint_summary(ckpt)
    where = f"{ckpt} (saved by {summary.get('world_size', '?')} rank(s) at optimizer step {summary.get('step', '?')})"
    if args.command == "merge":
        target = merge_checkpoint(ckpt, args.target_dir, args.hf_model_path, args.dtype)
        print(f"model_merger: merged {where} into {target}")
        return 0
    mismatches = compare_with_reference(ckpt, args.test_hf_dir, args.hf_model_path, rtol=args.rtol, atol=args.atol)
    if not mismatches:
        print(f"model_merger: {where} matches {args.test_hf_dir} (rtol={args.rtol}, atol={args.atol})")
        return 0
    print(f"model_merger: {len(mismatches)} tensor(s) of {where} differ from {args.test_hf_dir} "
          f"(rtol={args.rtol}, atol={args.atol}):", file=sys.stderr)
    for mismatch in mismatches[:MAX_LISTED]:
        print(f"  {mismatch}", file=sys.stderr)
    if len(mismatches) > MAX_LISTED:
        print(f"  ... and {len(mismatches) - MAX_LISTED} more", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""``hybridrl models ...``: make the built-in tiny models, prepare SmolLM2, list what is available.

hybridrl models make-tiny --preset tiny [--arch qwen2] [--seed 0] [--out DIR]
hybridrl models prepare smollm2-135m-instruct [--out DIR]
hybridrl models list
"""

from __future__ import annotations

import argparse

from hybridrl.models.tiny import ARCHS, PRESETS, default_tiny_dir, make_tiny_model_dir, preset_num_params
from hybridrl.models.utils import models_dir

PREPARABLE = ("smollm2-135m-instruct",)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrl models", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write a built-in tiny model + tokenizer as a HF folder")
    tiny.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    tiny.add_argument("--arch", default="qwen2", choices=list(ARCHS))
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--out", default=None, help="output folder (default: the model cache)")
    prep = sub.add_parser("prepare", help="convert a packaged real model into a HF folder")
    prep.add_argument("name", choices=list(PREPARABLE))
    prep.add_argument("--out", default=None, help="output folder (default: the model cache)")
    sub.add_parser("list", help="show presets, preparable models and the cache folder")
    return parser


def _list() -> None:
    print(f"cache folder: {models_dir()}  (override with $HYBRIDRL_MODELS_DIR)")
    print("tiny presets (make-tiny --preset NAME --arch qwen2|llama):")
    for name in PRESETS:
        qwen2, llama = (preset_num_params(name, arch) / 1e6 for arch in ARCHS)
        print(
            f"  {name:6s} {qwen2:6.2f}M params (qwen2), {llama:6.2f}M (llama); cached at {default_tiny_dir(name)}"
        )
    print("preparable models (prepare NAME):")
    for name in PREPARABLE:
        print(f"  {name}  needs: pip install 'hybridrl[smollm2]'")


def main(argv: list[str] | None = None) -> int:
    """Entry point used by ``hybridrl.cli``; returns the process exit code."""
    args = _parser().parse_args(argv)
    if args.command == "make-tiny":
        print(make_tiny_model_dir(args.out, preset=args.preset, arch=args.arch, seed=args.seed))
    elif args.command == "prepare":
        from hybridrl.models.smollm2 import prepare_smollm2  # imported late: it is the only heavy path

        try:
            print(prepare_smollm2(args.out))
        except ImportError as err:
            print(f"error: {err}")
            return 1
    else:
        _list()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

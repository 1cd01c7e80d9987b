"""The ``hybridrl`` command. Subcommands are imported lazily so ``hybridrl --help`` stays fast."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help). Each function takes argv (list[str]) -> int.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("hybridrl.trainer.main_ppo", "main", "PPO/GRPO training (same overrides as main_ppo)"),
    "sft": ("hybridrl.trainer.main_sft", "main", "supervised fine-tuning"),
    "quickstart": ("hybridrl.trainer.quickstart", "main", "train the built-in tiny model on a built-in task"),
    "config": ("hybridrl.config.cli", "main", "show or check a resolved config"),
    "data": ("hybridrl.data.cli", "main", "prepare data sets (gsm8k, math, countdown, synthetic tasks)"),
    "models": ("hybridrl.models.cli", "main", "make tiny models, prepare SmolLM2, list presets"),
    "eval": ("hybridrl.trainer.evaluate", "main", "evaluate a model folder on a parquet file"),
    "plot": ("hybridrl.trainer.plot", "main", "plot the metrics of a run directory"),
}


def usage() -> str:
    lines = ["usage: hybridrl <command> [args]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hybridrl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        entry = getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("hybridrl"):
            print(f"hybridrl: command {name!r} is not available in this build ({err})", file=sys.stderr)
            return 2
        raise
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end GRPO step: hybridrl vs TRL ``GRPOTrainer`` side by side, and vs the machine's floor.

Matched settings: the same model folder and parquet prompts (the built-in addition task, chat
template applied by each framework), N prompts x G samples, exactly R response tokens (hybridrl
``rollout.ignore_eos=true``, TRL ``min_new_tokens=R``), temperature 1, AdamW at the same lr /
betas / weight decay / grad clip, constant schedule, one PPO epoch and one optimizer step per
generation batch (no micro-batching on either side), the same Python reward (hybridrl's default
scorer), and with or without a reference model (k3 KL loss, coefficient 0.001 on both sides).

Both compile their model by default (matched): hybridrl its transformer blocks
(``actor_rollout_ref.actor.use_torch_compile=true``), TRL through transformers' Trainer
(``GRPOConfig(torch_compile=True)``); ``--compile off`` / ``--trl-compile off`` run either eager. The
compilation happens in the first step of a run, which is dropped with the other warm-up steps.

The frameworks alternate within one run (hybridrl run, TRL run, hybridrl run, ...); each run does
``--steps`` steps, the first ``--warmup`` (2) of which are dropped for both frameworks: compilation
in the first, and in the second TRL's recompilation for new shapes and, for hybridrl, the
allocator still growing its heap (the second step of a 25M run took 14.4 s against 10.8 s for the
third). The median over all kept steps is reported. hybridrl runs in-process (``trainer.backend=local``, one rank, torch's threads)
like TRL, unless ``--backend ray``. Token counts are the dataset's mean real prompt length plus R,
times B, for both frameworks, so the throughput ratio is the step-time ratio.

    python benchmarks/grpo_bench.py --case tiny            # one case -> benchmarks/results/<machine>/grpo_tiny.json
    python benchmarks/grpo_bench.py --case 25m --reps 2 --steps 4 --no-trl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import (  # noqa: E402
    PHASES,
    WORKER_PHASES,
    Machine,
    ModelShape,
    against_floor,
    provenance,
    results_dir,
    split_runs,
    step_floor,
)

LR, KL_COEF, WEIGHT_DECAY, GRAD_CLIP = 1e-6, 0.001, 0.01, 1.0
RATE_REPS = 10  # runs of each peak product per backend in each measurement before a run (the file's first: 20)


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # tiny | small | 25m | smollm2
    n: int  # prompts per step
    g: int  # samples per prompt
    r: int  # response tokens
    max_prompt_length: int
    mini_batch: int = 0  # prompts per PPO mini-batch (0: all n, one optimizer step per batch)


CASES = {
    "tiny": Case("tiny", "tiny", 16, 8, 64, 64),
    "25m": Case("25m", "25m", 8, 8, 64, 64),
    "smollm2": Case("smollm2", "smollm2", 4, 4, 32, 128),
    # the quickstart's sizes (hybridrl/config/presets/grpo_quickstart.yaml): 32 prompts x 8 samples x
    # 12 tokens in two mini-batches, so the old log-probs are computed; hybridrl only (TRL has no
    # matching mini-batch schedule), for the controller's share of a step at that size
    "quickstart": Case("quickstart", "tiny", 32, 8, 12, 64, mini_batch=16),
}


# ------------------------------------------------------------------------------------ assets
def prepare_assets(case: Case, root: Path) -> dict[str, str]:
    """Model folder (built offline) and the addition task's train parquet."""
    from hybridrl.data.preprocess import prepare
    from hybridrl.models import make_tiny_model_dir

    data = root / "data"
    if not (data / "train.parquet").exists():
        prepare("addition", data, n=4096, n_test=8, seed=0, max_digits=3)
    if case.model == "smollm2":
        from hybridrl.models.smollm2 import prepare_smollm2

        model = prepare_smollm2()
    else:
        model = make_tiny_model_dir(preset=case.model)
    return {"model": str(model), "train": str(data / "train.parquet")}


def mean_prompt_tokens(model_dir: str, train_file: str, rows: int = 512) -> float:
    """Mean real prompt length after the chat template (what both frameworks prefill)."""
    import pyarrow.parquet as pq

    from hybridrl.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    prompts = pq.read_table(train_file, columns=["prompt"]).column("prompt").to_pylist()[:rows]
    lengths = [len(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
               for p in prompts]
    return statistics.fmean(lengths)


# ---------------------------------------------------------------------------------- hybridrl
def hybridrl_overrides(case: Case, assets: dict, run_dir: Path, steps: int, with_ref: bool,
                       backend: str, workers: int, compile_blocks: bool, eos: bool = False) -> list[str]:
    """The case as hybridrl config overrides; ``eos``: responses end at the model's end-of-sequence
    token (mixed lengths) instead of running to exactly R tokens."""
    b = case.n * case.g
    values = {
        "data.train_files": f"[{assets['train']}]", "data.val_files": "[]",
        "data.train_batch_size": case.n, "data.max_prompt_length": case.max_prompt_length,
        "data.max_response_length": case.r, "actor_rollout_ref.model.path": assets["model"],
        "actor_rollout_ref.rollout.n": case.g, "actor_rollout_ref.rollout.ignore_eos": str(not eos).lower(),
        "actor_rollout_ref.rollout.temperature": 1.0,
        "actor_rollout_ref.actor.ppo_mini_batch_size": case.mini_batch or case.n,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (case.mini_batch or case.n) * case.g // workers,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": b // workers,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": b // workers,
        "actor_rollout_ref.actor.use_kl_loss": str(with_ref).lower(),
        "actor_rollout_ref.actor.kl_loss_coef": KL_COEF, "actor_rollout_ref.actor.optim.lr": LR,
        "actor_rollout_ref.actor.optim.weight_decay": WEIGHT_DECAY, "actor_rollout_ref.actor.grad_clip": GRAD_CLIP,
        "trainer.total_training_steps": steps, "trainer.val_before_train": "false", "trainer.test_freq": -1,
        "trainer.save_freq": -1, "trainer.logger": "[file]", "trainer.default_local_dir": str(run_dir),
        "trainer.resume_mode": "disable", "trainer.backend": backend, "trainer.n_cpu_workers": workers,
        "actor_rollout_ref.actor.use_torch_compile": str(compile_blocks).lower(),
    }
    return [f"{k}={v}" for k, v in values.items()]


def run_hybridrl(case: Case, assets: dict, steps: int, with_ref: bool, backend: str = "local",
                 workers: int = 1, compile_blocks: bool = False, extra: tuple[str, ...] = (),
                 eos: bool = False) -> list[dict]:
    """Per-step metrics (timing_s/*, prompt_length/mean, actor/padding_ratio ...) of one run;
    ``extra``: more ``key=value`` overrides, after the case's; ``eos``: see `hybridrl_overrides`."""
    from hybridrl.config import load_config
    from hybridrl.trainer.main_ppo import run

    with tempfile.TemporaryDirectory(prefix="hybridrl-bench-") as tmp:
        config = load_config(hybridrl_overrides(case, assets, Path(tmp), steps, with_ref, backend, workers,
                                                compile_blocks, eos) + list(extra), preset="grpo_quickstart")
        run(config)
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# --------------------------------------------------------------------------------------- TRL
def trl_reward(prompts, completions, data_source, reward_model, **_):
    """hybridrl's default scorer behind TRL's reward-function signature."""
    from hybridrl.rewards.default import default_compute_score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(default_compute_score(src, text, rm["ground_truth"]))
            for src, text, rm in zip(data_source, texts, reward_model)]


def run_trl(case: Case, assets: dict, steps: int, with_ref: bool, compile_model: bool = False) -> list[float]:
    """Seconds of each optimizer step (generation included) of one GRPOTrainer run."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.start)

    b = case.n * case.g
    dataset = Dataset.from_parquet(assets["train"])
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, per_device_train_batch_size=b, gradient_accumulation_steps=1,
            num_generations=case.g, max_completion_length=case.r, generation_kwargs={"min_new_tokens": case.r},
            temperature=1.0, top_p=1.0, top_k=0, beta=KL_COEF if with_ref else 0.0, num_iterations=1,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=WEIGHT_DECAY,
            max_grad_norm=GRAD_CLIP, gradient_checkpointing=False, max_steps=steps, logging_steps=10**6, save_strategy="no", report_to="none",
            disable_tqdm=True, seed=0, bf16=False, model_init_kwargs={"dtype": torch.float32},
            dataloader_num_workers=0, torch_compile=compile_model)
        timer = StepTimer()
        trainer = GRPOTrainer(model=assets["model"], reward_funcs=trl_reward, args=args, train_dataset=dataset,
                              callbacks=[timer])
        trainer.train()
    return timer.seconds


# ----------------------------------------------------------------------------------- summary
def phase_times(step: dict) -> dict[str, float]:
    """hybridrl's phases of one step as the driver times them; ``controller``: the step time outside
    every phase (the driver's own work). ``dispatch`` is not a phase of its own but the part of the
    worker calls' phases spent outside the workers (sending, (de)serialising and returning batches):
    those phases' time minus ``perf/time_in_workers``; it is already inside them."""
    out = {p: float(step.get(f"timing_s/{p}", 0.0)) for p in PHASES if p not in ("dispatch", "controller")}
    out["controller"] = float(step["timing_s/step"]) - sum(out.values())
    in_workers = step.get("perf/time_in_workers")
    out["dispatch"] = max(0.0, sum(out[p] for p in WORKER_PHASES) - in_workers) if in_workers is not None else 0.0
    return out


def summarize(case: Case, hyb: list[dict], trl: list[float], tokens: float, floor: dict) -> dict:
    hyb_step = statistics.median(s["timing_s/step"] for s in hyb)
    phases = {p: statistics.median(phase_times(s)[p] for s in hyb) for p in PHASES}
    # the MFU against the matmul rate of every rank of the case together (``step_floor``)
    floor_frac, update_mfu = against_floor(hyb_step, phases["update_actor"], floor)
    out = {
        "hybridrl_step_s": hyb_step, "hybridrl_tok_s": tokens / hyb_step,
        "hybridrl_floor_frac": floor_frac,
        "phases_s": phases, "phase_floor_s": floor["seconds"],
        "update_mfu": update_mfu,
        "padding_efficiency": statistics.median(1.0 / s["actor/padding_ratio"] for s in hyb
                                                if s.get("actor/padding_ratio")) if hyb else None,
        # update positions computed per real token: below 1 where the group's prompt is computed once
        "positions_per_token": statistics.median(s["actor/compute_ratio"] for s in hyb
                                                 if s.get("actor/compute_ratio")) if hyb else None,
        # issue 10's "controller overhead": time not spent in any worker (reward scoring aside)
        "controller_frac": (phases["controller"] + phases["dispatch"]) / hyb_step,
        "hybridrl_steps": [s["timing_s/step"] for s in hyb],
    }
    if trl:
        trl_step = statistics.median(trl)
        out.update(trl_step_s=trl_step, trl_tok_s=tokens / trl_step, speedup=trl_step / hyb_step,
                   trl_floor_frac=floor["total_s"] / trl_step, trl_steps=trl)
    return out


def run_fractions(hyb: list[dict], floors: list[dict]) -> dict:
    """Each run's own fraction of the floor and update MFU, in the order the runs ran: run i's kept
    steps (the i-th equal share of ``hyb``) against ``floors[i]``, the floor at the rates measured just
    before that run. The row's own figures pool the steps and take the median of those rates; the
    rate moves between runs on a shared machine (a Xeon's two measurements of one row read 213 and
    191 GFLOP/s), and the spread of these is how far the row's figures could move on another
    sitting. Empty where the kept steps do not split evenly into the runs; the MFUs None where a run
    had no update."""
    runs = split_runs(hyb, len(floors))
    if not runs:
        return {}
    fracs, mfus = [], []
    for run, floor in zip(runs, floors):
        frac, mfu = against_floor(statistics.median(s["timing_s/step"] for s in run),
                                  statistics.median(phase_times(s)["update_actor"] for s in run), floor)
        fracs.append(frac)
        mfus.append(mfu)
    return {"floor_frac_runs": fracs, "update_mfu_runs": None if None in mfus else mfus}


def floor_ranks(args) -> int:
    """Ranks the floor splits the step over: the Ray workers, each with ``--threads`` threads on cores
    of its own; the local backend is one rank."""
    return args.workers if args.backend == "ray" else 1


def machine_during(samples: list[Machine]) -> Machine:
    """The machine's rates over a row's runs: the median of the measurements taken before each run.
    A shared machine's speed drifts (a Zen 1 here read 43.7 GFLOP/s at the start of `make bench` and
    35.9 an hour later), so a floor from one measurement at the start of a file would be off by as
    much for the rows run later."""
    return Machine(statistics.median(m.peak_flops for m in samples), statistics.median(m.bandwidth for m in samples),
                   samples[0].cpu, samples[0].ranks, samples[0].peak_of)


def bench_case(case: Case, args, with_ref: bool) -> dict:
    from transformers import AutoModelForCausalLM

    assets = prepare_assets(case, Path(args.work))
    shape = ModelShape.of(AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32))
    p = mean_prompt_tokens(assets["model"], assets["train"])
    tokens = case.n * case.g * (p + case.r)
    hyb: list[dict] = []
    trl: list[float] = []
    samples: list[Machine] = []
    for rep in range(args.reps):
        samples.append(Machine.measure(peak_reps=RATE_REPS, ranks=floor_ranks(args)))
        hyb += run_hybridrl(case, assets, args.steps, with_ref, args.backend, args.workers,
                            args.compile == "on", tuple(args.override), args.eos)[args.warmup:]
        if not args.no_trl:
            with threads_for(trl_threads(args)):
                trl += run_trl(case, assets, args.steps, with_ref, args.trl_compile == "on")[args.warmup:]
        print(f"[{case.name} ref={with_ref}] rep {rep}: hybridrl {[round(s['timing_s/step'], 2) for s in hyb]} "
              f"trl {[round(t, 2) for t in trl]}", flush=True)
    machine = machine_during(samples)
    r = case.r
    if args.eos:  # the tokens the steps really had; the floor of their mean response length
        tokens = statistics.median(s["perf/total_num_tokens"] for s in hyb)
        r = max(1, round(statistics.median(s["response_length/mean"] for s in hyb)))
    def floor_at(rates: Machine) -> dict:
        return step_floor(shape, rates, case.n, case.g, p, r, with_ref,
                          with_old=bool(case.mini_batch) and case.mini_batch < case.n, ranks=floor_ranks(args))

    floor = floor_at(machine)
    result = summarize(case, hyb, trl, tokens, floor)
    result.update(run_fractions(hyb, [floor_at(sample) for sample in samples]))
    result.update(machine=asdict(machine), peak_samples=[m.peak_flops for m in samples],
                  case=asdict(case), with_ref=with_ref, params=shape.params, mean_prompt_tokens=p,
                  tokens_per_step=tokens, floor_s=floor["total_s"], floor_ranks=floor["ranks"],
                  floor_peak_flops=floor["peak_flops"], overrides=args.override, backend=args.backend, workers=args.workers,
                  threads=args.threads, trl_threads=None if args.no_trl else trl_threads(args),
                  hybridrl_compile=args.compile == "on", trl_compile=args.trl_compile == "on")
    if args.eos:
        result.update(eos=True, floor_response_tokens=r, **mixed_lengths(hyb, case.n * case.g))
    return result


def mixed_lengths(steps: list[dict], rows: int) -> dict:
    """How mixed the lengths of an ``--eos`` run were (medians over its kept steps of each step's
    shortest, mean and longest prompt and response), and the padding efficiency of a padded batch
    on the same steps: the real tokens over rows x (longest prompt + longest response), the positions
    an update computes when it pads every row to the batch's longest prompt and response (as TRL's
    GRPOTrainer does)."""
    def median(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    out = {f"{part}_length_{stat}": median(f"{part}_length/{stat}")
           for part in ("prompt", "response") for stat in ("min", "mean", "max")}
    out["padded_efficiency"] = statistics.median(
        s["perf/total_num_tokens"] / (rows * (s["prompt_length/max"] + s["response_length/max"])) for s in steps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--ref", default="both", choices=("both", "on", "off"), help="reference model")
    parser.add_argument("--reps", type=int, default=3, help="alternating runs per framework")
    parser.add_argument("--steps", type=int, default=4, help="steps per run, warm-up steps included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run not counted (both frameworks)")
    parser.add_argument("--n", type=int, default=0, help="override the case's prompts per step")
    parser.add_argument("--r", type=int, default=0, help="override the case's response tokens (with --eos: the limit)")
    parser.add_argument("--backend", default="local", choices=("local", "ray"))
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--no-trl", action="store_true", help="hybridrl only")
    parser.add_argument("--compile", default="on", choices=("on", "off"),
                        help="hybridrl: actor_rollout_ref.actor.use_torch_compile (compiled transformer blocks)")
    parser.add_argument("--trl-compile", default="on", choices=("on", "off"),
                        help="TRL: GRPOConfig(torch_compile=...) (transformers' Trainer compiles the model)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a hybridrl config override after the case's (repeatable), e.g. "
                             "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1")
    parser.add_argument("--eos", action="store_true",
                        help="responses end at the model's end-of-sequence token (rollout.ignore_eos=false), so "
                             "their lengths are mixed: the update's padding with mixed lengths; hybridrl only "
                             "(--no-trl: TRL's tokens would no longer match), its floor at the mean length")
    parser.add_argument("--tag", default="", help="suffix of the result file")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both frameworks (1: see docs/performance.md on shared machines)")
    parser.add_argument("--trl-threads", type=int, default=0,
                        help="torch threads for TRL alone (0: --threads); with --backend ray --workers 2 --threads 1 "
                             "and --trl-threads 2, each framework uses two cores its own way")
    parser.add_argument("--work", default=os.path.expanduser("~/.cache/hybridrl/bench"))
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup} (those steps are not counted)")
    if args.eos and not args.no_trl:
        parser.error("--eos needs --no-trl: with mixed response lengths the two frameworks' tokens no longer match")
    provenance()  # the code as the run starts (floor.provenance)
    case = CASES[args.case]
    if args.n:
        case = dataclasses.replace(case, n=args.n)
    if args.r:
        case = dataclasses.replace(case, r=args.r)
    set_threads(args.threads)
    torch.manual_seed(0)
    machine = Machine.measure()
    refs = {"both": (False, True), "on": (True,), "off": (False,)}[args.ref]
    rows = [bench_case(case, args, with_ref) for with_ref in refs]
    record = {"machine": asdict(machine), "threads": torch.get_num_threads(), "load_avg_end": os.getloadavg()[0],
              "reps": args.reps, "steps": args.steps, "warmup": args.warmup, "rows": rows, "versions": versions(),
              "measured": provenance()}
    out = results_dir() / f"grpo_{args.case}{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


def set_threads(threads: int) -> None:
    """The same thread count for hybridrl's workers (HYBRIDRL_NUM_THREADS), TRL (accelerate reads
    OMP_NUM_THREADS) and the matmul-rate measurement, so the floor is the one both run against."""
    os.environ["HYBRIDRL_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def trl_threads(args) -> int:
    return args.trl_threads or args.threads


@contextlib.contextmanager
def threads_for(threads: int):
    """TRL's run at ``threads`` torch threads (``--trl-threads``), then back to the driver's count."""
    before = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        if before[1] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before[1]


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "trl", "ray", "hybridrl"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "-"
    return out


if __name__ == "__main__":
    raise SystemExit(main())

"""The machine's limit for one GRPO step: FLOPs of each phase over the measured fp32 matmul rate,
decode steps bounded below by reading the weights once (issue 10).

Shape letters as in hybridrl.protocol: N prompts, G samples per prompt, B = N*G sequences, p the
mean real prompt length (padding excluded), R response tokens per sequence.

Work per step with M = matmul parameters (every nn.Linear of the decoder layers plus the LM head;
embeddings are lookups), L layers, D = heads x head_dim per layer:

- generation: prefill 2M per prompt token (each prompt once, its KV cache shared by its G samples),
  2M per generated token, attention 4LD per (query, key) pair; each of the R decode steps is
  max(its FLOPs / peak, weight bytes / bandwidth);
- every extra forward (reference log-probs): 2M per token, each prompt once (its activations are
  the same in all G rows of its group; hybridrl computes them once, ``hybridrl.engine.shared_prefix``)
  and the R - 1 response tokens that predict one (the last predicts nothing), attention over the
  prompt and the row's own tokens;
- update: 6M per token of that forward (forward + backward), attention 3x the forward's;
- old log-probs, weight sync, reward and controller: 0 (an exactly on-policy update needs no old
  log-probs; a colocated rollout can read the actor's weights in place; scoring strings is not
  model work and can overlap).

With several worker ranks the rows are split over them and the ranks run at once, each on its own
cores: the floor is one rank's share, and the rate an MFU is measured against is all ranks' together,
each rank's rate measured while all of them compute (``measure_rates_together``).
"""

from __future__ import annotations

import functools
import os
import platform
import queue
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridrl.utils.native_build import cpu_fields

# Inner products of the kind the update runs (rows, in, out; the weight as stored or as the transposed
# view an input gradient reads), timed beside the square matmul. A peak is the most the machine
# does, and the square alone is not that: on a Zen 1 (one thread, best of 20 each, two rounds) the
# square 1536 read 42.4-42.9 GFLOP/s through either backend in the minutes that 2048 x 512 x 512 on
# a transposed weight read 44.8 and 4096 x 128 x 384 44.3, products the tiny and 25M updates run
# themselves; an MFU against the square alone read a twentieth too high there.
PEAK_PRODUCTS = ((2048, 512, 512), (4096, 128, 384))
PEAK_OF = "square and inner products"  # ``Machine.peak_of`` of a peak measured here


def measure_peak_flops(size: int = 1536, reps: int = 20) -> float:
    """fp32 matmul FLOP/s: best of ``reps`` runs of each product, the fastest product counting: a
    square matmul and the ``PEAK_PRODUCTS`` (weight as stored and transposed), each through every CPU
    backend this torch has (MKL's and, where present, oneDNN's). A peak is an upper bound, so the best;
    on a shared machine a few reps can all land in a slow moment (5 once read 104 GFLOP/s where the
    run before read 153). Both backends, because MKL runs its AVX2 code on AMD CPUs at about half
    the rate oneDNN reaches there (``hybridrl.utils.cpu_matmul``), and hybridrl uses whichever is
    faster: a floor from MKL alone would put the machine's limit at half of what it is."""
    return best_rate(peak_products(size), reps)


def peak_products(size: int = 1536) -> list[tuple[float, Callable[[], object]]]:
    """(FLOPs, product) of every product ``measure_peak_flops`` times, its operands made here."""
    from hybridrl.utils.cpu_matmul import onednn_available

    dnn = onednn_available()
    a, b = torch.randn(size, size), torch.randn(size, size)
    products = [(2.0 * size**3, lambda: a @ b)]
    if dnn:
        products.append((2.0 * size**3, lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")))
    for rows, inner, out in PEAK_PRODUCTS:
        x = torch.randn(rows, inner)
        for w in (torch.randn(out, inner), torch.randn(inner, out).t()):
            flops = 2.0 * rows * inner * out
            products.append((flops, lambda x=x, w=w: torch.nn.functional.linear(x, w)))
            if dnn:
                products.append((flops, lambda x=x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")))
    return products


def best_rate(products: list[tuple[float, Callable[[], object]]], reps: int,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """The highest FLOP/s of any product, each timed ``reps`` times after one untimed run (its best)."""
    best = 0.0
    for flops, product in products:
        product()
        fastest = float("inf")
        for _ in range(reps):
            start = clock()
            product()
            fastest = min(fastest, clock() - start)
        best = max(best, flops / fastest)
    return best


def rates_sentence(peak: float, bandwidth: float) -> str:
    """The line a rollout benchmark's table opens with: the rates it measured and the load at its end."""
    return (f"Measured in the same run: fp32 matmul peak {peak / 1e9:.1f} GFLOP/s (the best of a square matmul and "
            f"two inner products, `floor.measure_peak_flops`), memory read {bandwidth / 1e9:.1f} GB/s; load average "
            f"at the end {os.getloadavg()[0]:.1f}.")


def measure_bandwidth(megabytes: int = 512, reps: int = 5) -> float:
    """Memory read bytes/s: best of ``reps`` sums over a buffer far larger than the caches."""
    buf = torch.ones(megabytes * 2**20 // 4)
    buf.sum()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best


@dataclass(frozen=True)
class ModelShape:
    matmul_params: int  # M: decoder-layer Linear weights + LM head
    attn_dim: int  # L x heads x head_dim, summed over layers
    weight_bytes: int  # fp32 bytes read once per decode step
    params: int  # all parameters (tied embeddings once)

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        cfg = model.config
        head = model.get_output_embeddings().weight.numel()
        layers = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(matmul_params=layers + head, attn_dim=cfg.num_hidden_layers * cfg.num_attention_heads * head_dim,
                   weight_bytes=4 * (layers + head), params=sum(p.numel() for p in model.parameters()))


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU a result was measured on: its name, family and model numbers, vector instructions and
    CPU count, e.g. "AMD EPYC (family 25, model 17), AVX-512, 2 CPUs".

    A virtual machine may name every EPYC generation "AMD EPYC", and the generations differ by up to
    2.2x in one thread's fp32 matmul rate (Zen 3 64-87 GFLOP/s with AVX2, Zen 4 100-107 with AVX-512
    on 256-bit units, Zen 5 210-240): the family and model numbers tell them apart, and the vector
    instructions decide which of hybridrl's kernels run (docs/performance.md). ``cpuinfo``: the text
    of /proc/cpuinfo (read when None; other systems get the platform's processor name)."""
    fields = cpu_fields(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    flags = set(fields.get("flags", "").split())
    if "avx512f" in flags:
        isa = "AVX-512"
    elif {"avx2", "fma"} <= flags:
        isa = "AVX2 + FMA"
    else:
        isa = "no AVX2" if flags else ""
    count = os.cpu_count() or 0
    return ", ".join(part for part in (name, isa, f"{count} CPUs" if count else "") if part)


# AMD's core generations by (family, model range), from AMD's processor programming references: the
# families alone do not tell Zen 3 from Zen 4 (both 0x19), and they differ by 1.3-1.6x in one
# thread's fp32 matmul rate. CPUs not listed get their numbers in the folder name instead.
AMD_GENERATIONS = (
    (0x17, range(0x00, 0x30), "zen1"), (0x17, range(0x30, 0x100), "zen2"),
    (0x19, range(0x00, 0x10), "zen3"), (0x19, range(0x10, 0x20), "zen4"), (0x19, range(0x20, 0x60), "zen3"),
    (0x19, range(0x60, 0x80), "zen4"), (0x19, range(0xA0, 0xB0), "zen4"),
    (0x1A, range(0x00, 0x50), "zen5"), (0x1A, range(0x60, 0x80), "zen5"),
)


def machine_key(cpuinfo: str | None = None) -> str:
    """The folder of ``benchmarks/results`` a machine's results go to: its core generation where it is
    known (``zen4``), else the vendor, family and model (``intel-f6-m143``), else the architecture.
    ``$HYBRIDRL_BENCH_MACHINE`` names it instead (a machine the numbers cannot tell apart)."""
    if os.environ.get("HYBRIDRL_BENCH_MACHINE"):
        return os.environ["HYBRIDRL_BENCH_MACHINE"]
    fields = cpu_fields(cpuinfo)
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return platform.machine().lower() or "unknown"
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(fields.get("vendor_id", ""), "cpu")
    if vendor == "amd":
        for fam, models, generation in AMD_GENERATIONS:
            if family == fam and model in models:
                return generation
    return f"{vendor}-f{family}-m{model}"


@functools.cache
def provenance() -> str:
    """When and from which code a result was measured: "2026-12-04 at 7411a43" (``+`` marks changes
    to hybridrl/ or the measuring scripts not yet committed; no commit outside a git checkout). The
    first call's answer for the whole process: the benchmarks call it as they start, so a commit or
    an edit made while a run is measuring does not relabel it (written at the end, one run's file
    named a commit made after it had started)."""
    root = Path(__file__).resolve().parent.parent
    day = time.strftime("%Y-%m-%d", time.gmtime())

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return day
    # what is measured: hybridrl and the benchmark scripts (not report.py, which only reads results)
    dirty = git("status", "--porcelain", "--", "hybridrl", "benchmarks/*.py", ":!benchmarks/report.py")
    return f"{day} at {commit}{'+' if dirty else ''}"


def results_dir(root: Path | None = None) -> Path:
    """Where this machine's benchmark results are written: ``benchmarks/results/<machine_key()>``, so
    runs on different CPUs sit side by side instead of overwriting each other (``report.py`` puts
    them next to each other in BENCHMARKS.md)."""
    return (root or Path(__file__).resolve().parent / "results") / machine_key()


@dataclass(frozen=True)
class Machine:
    peak_flops: float  # fp32 matmul FLOP/s of one rank, while all ``ranks`` compute at once
    bandwidth: float  # memory read bytes/s of one rank, likewise
    cpu: str = ""  # cpu_description()
    ranks: int = 1  # processes measured at once (records written before the field: one)
    peak_of: str = "square"  # what peak_flops is the best of (records before PEAK_OF: the square alone)

    @classmethod
    def measure(cls, peak_reps: int = 20, ranks: int = 1) -> Machine:
        """The rates one rank gets while ``ranks`` ranks (processes with this process's thread count)
        run at once. One rank: measured here. Several: ``measure_rates_together``; two one-thread
        processes on a two-core Zen 1 read 36.5-37.1 GFLOP/s each where one alone read 41.0-41.5,
        so twice one rank's rate alone would put the two cores' limit a tenth above what they do."""
        if ranks == 1:
            return cls(measure_peak_flops(reps=peak_reps), measure_bandwidth(), cpu_description(), 1, PEAK_OF)
        peak, bandwidth = measure_rates_together(ranks, torch.get_num_threads(), peak_reps)
        return cls(peak, bandwidth, cpu_description(), ranks, PEAK_OF)


def _rank_rates(threads: int, peak_reps: int, size: int, megabytes: int, start, results) -> None:
    """One process of ``measure_rates_together``: warm up, wait for the others, then measure."""
    torch.set_num_threads(threads)
    measure_peak_flops(size, reps=1)
    start.wait()
    results.put((os.getpid(), measure_peak_flops(size, reps=peak_reps), measure_bandwidth(megabytes)))


def measure_rates_together(ranks: int, threads: int, peak_reps: int = 20, size: int = 1536,
                           megabytes: int = 512) -> tuple[float, float]:
    """Matmul FLOP/s and memory bytes/s per rank, with ``ranks`` fresh processes of ``threads``
    threads each measuring at the same time (the mean over them): the rate each of a step's ranks can
    reach while the others compute too, since they share the caches, memory and the chip's power."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(ranks), context.Queue()
    workers = [context.Process(target=_rank_rates, args=(threads, peak_reps, size, megabytes, start, results))
               for _ in range(ranks)]
    for worker in workers:
        worker.start()
    rates = []
    try:
        while len(rates) < ranks:
            try:
                rates.append(results.get(timeout=1))
            except queue.Empty:
                failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a rate-measuring process failed (exit codes {failed}); its traceback is above") from None
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
    if len({pid for pid, _, _ in rates}) != ranks:
        raise RuntimeError(f"expected {ranks} processes to measure, got answers from {[pid for pid, _, _ in rates]}")
    return sum(r[1] for r in rates) / ranks, sum(r[2] for r in rates) / ranks


def _attn_pairs(length: float) -> float:
    """(query, key) pairs of causal attention over one sequence of ``length`` tokens."""
    return length * (length + 1) / 2


def forward_flops(shape: ModelShape, rows: float, length: float) -> float:
    """One forward over ``rows`` sequences of ``length`` tokens."""
    return rows * (2 * shape.matmul_params * length + 4 * shape.attn_dim * _attn_pairs(length))


def shared_forward_flops(shape: ModelShape, n: float, g: int, p: float, r: int) -> float:
    """One forward over N prompts of ``p`` tokens, each once, and the R - 1 response tokens of its G
    rows that predict a token, attending to the prompt and causally to their own."""
    fed = max(0, r - 1)
    tokens = n * p + n * g * fed
    pairs = n * _attn_pairs(p) + n * g * (fed * p + _attn_pairs(fed))
    return 2 * shape.matmul_params * tokens + 4 * shape.attn_dim * pairs


def generation_floor(shape: ModelShape, machine: Machine, n: float, g: int, p: float, r: int) -> tuple[float, float]:
    """(FLOPs, seconds) of prefilling N prompts once and decoding R tokens for B = N*G rows."""
    flops = forward_flops(shape, n, p)
    seconds = max(flops / machine.peak_flops, shape.weight_bytes / machine.bandwidth)
    for step in range(1, r):
        step_flops = n * g * (2 * shape.matmul_params + 4 * shape.attn_dim * (p + step))
        flops += step_flops
        seconds += max(step_flops / machine.peak_flops, shape.weight_bytes / machine.bandwidth)
    return flops, seconds


def step_floor(shape: ModelShape, machine: Machine, n: int, g: int, p: float, r: int, with_ref: bool,
               with_old: bool = False, ranks: int = 1) -> dict:
    """Per-phase floor seconds (and FLOPs) of one GRPO step; keys match ``PHASES``. ``with_old``:
    the old log-probs need their own forward pass (more than one mini-batch per batch).

    ``ranks``: the step's rows split evenly over that many worker ranks running at once, each on
    cores of its own at ``machine``'s rates (one rank's, measured at its thread count while as many
    ranks measured at once: ``Machine.measure(ranks=...)``). The floor is then one rank's share
    (N / ranks prompts), and ``peak_flops`` the rate of all ranks together, which an MFU divides by:
    a floor at one rank's rate would read a two-rank step as twice as close to the limit as it is.
    ``flops`` are the whole step's."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    share = n / ranks
    gen_flops, gen_s = generation_floor(shape, machine, share, g, p, r)
    fwd = shared_forward_flops(shape, share, g, p, r)
    ref = fwd if with_ref else 0.0
    update = 3 * fwd  # backward = 2x forward
    per_rank = {"gen": gen_flops, "reward": 0.0, "old_log_prob": fwd if with_old else 0.0, "ref": ref,
                "update_actor": update, "update_weights": 0.0, "dispatch": 0.0, "controller": 0.0}
    seconds = {k: v / machine.peak_flops for k, v in per_rank.items()}
    seconds["gen"] = gen_s
    return {"flops": {k: v * ranks for k, v in per_rank.items()}, "seconds": seconds,
            "total_s": sum(seconds.values()), "update_flops": update * ranks,
            "peak_flops": machine.peak_flops * ranks, "ranks": ranks}


def against_floor(step_s: float, update_s: float, floor: dict) -> tuple[float, float | None]:
    """(fraction of the floor, update MFU) of a step taking ``step_s`` with its update ``update_s``,
    against ``step_floor``'s ``floor``; the MFU None without an update."""
    return (floor["total_s"] / step_s,
            floor["update_flops"] / update_s / floor["peak_flops"] if update_s else None)


def split_runs(values: list, runs: int) -> list[list] | None:
    """``values`` (the kept steps of ``runs`` runs, in the order they ran) as one list per run; None
    where there are none or they do not split evenly."""
    if not values or runs < 1 or len(values) % runs:
        return None
    each = len(values) // runs
    return [values[i * each:(i + 1) * each] for i in range(runs)]


PHASES = ("gen", "reward", "old_log_prob", "ref", "update_actor", "update_weights", "controller", "dispatch")
# phases that are calls on the worker group (timed by the driver, so their time includes the dispatch)
WORKER_PHASES = ("gen", "old_log_prob", "ref", "update_actor", "update_weights")

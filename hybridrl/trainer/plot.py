"""``hybridrl plot <run_dir>``: training curves (PNG) and a one-page Markdown run report.

Reads ``<run_dir>/metrics.jsonl`` (written by ``trainer.logger=[file]``; when a resumed run logged a
step twice, the last record of the step wins) and writes

    <run_dir>/plots/score.png            critic/score/mean and every val-core/* curve
    <run_dir>/plots/response_length.png  response_length/mean, response_length/clip_ratio (right axis)
    <run_dir>/plots/entropy.png          actor/entropy
    <run_dir>/plots/kl.png               actor/kl_loss, actor/ppo_kl
    <run_dir>/plots/grad_norm.png        actor/grad_norm, critic/grad_norm
    <run_dir>/plots/timing.png           timing_s/* stacked (timing_s/step, the total, as a line)
    <run_dir>/report.md                  config, curves, first/last metrics, sample generations

A plot whose metrics were never logged is skipped. PNGs need matplotlib (``pip install
'hybridrl[plot]'``); without it the report is still written, without curves.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from hybridrl.trainer.dumps import latest_dump, read_jsonl

Metrics = dict[int, dict[str, float]]
KEY_METRICS = (
    "critic/score/mean", "critic/rewards/mean", "response_length/mean", "response_length/clip_ratio",
    "actor/entropy", "actor/kl_loss", "actor/ppo_kl", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss",
    "timing_s/step", "perf/throughput",
)


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: ``keys`` (exact names) and ``prefixes`` (every metric starting with one) on the left
    axis, ``right`` on a second axis; ``stacked`` draws the left series as a stacked area."""

    name: str
    title: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    right: tuple[str, ...] = ()
    stacked: bool = False


PLOTS = (
    PlotSpec("score", "score", keys=("critic/score/mean",), prefixes=("val-core/",)),
    PlotSpec("response_length", "response length", keys=("response_length/mean",),
             right=("response_length/clip_ratio",)),
    PlotSpec("entropy", "entropy", keys=("actor/entropy",)),
    PlotSpec("kl", "KL", keys=("actor/kl_loss", "actor/ppo_kl")),
    PlotSpec("grad_norm", "grad norm", keys=("actor/grad_norm", "critic/grad_norm")),
    PlotSpec("timing", "time per phase (s)", prefixes=("timing_s/",), right=("timing_s/step",), stacked=True),
)


# ------------------------------------------------------------------------------------ reading
def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{where}: value {value!r} is not a number")
    try:
        return float(value)  # the file backend writes NaN/inf as the strings "nan"/"inf"
    except ValueError as err:
        raise ValueError(f"{where}: value {value!r} is not a number") from err


def read_metrics(path: str | Path) -> Metrics:
    """``{step: {metric: value}}`` from a metrics.jsonl, sorted by step; the LAST record of a step
    wins (a resumed run repeats the steps after its checkpoint)."""
    out: Metrics = {}
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {number}: not JSON ({err})") from err
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError(f"{path} line {number}: expected an object with a 'step' key")
            step = int(record.pop("step"))
            out[step] = {k: _number(v, f"{path} line {number} key {k!r}") for k, v in record.items()}
    return dict(sorted(out.items()))


def series(metrics: Metrics, key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of one metric (steps where it is missing or not finite are skipped)."""
    points = [(s, m[key]) for s, m in metrics.items() if key in m and math.isfinite(m[key])]
    return [s for s, _ in points], [v for _, v in points]


def plot_keys(spec: PlotSpec, metrics: Metrics) -> tuple[list[str], list[str]]:
    """(left-axis keys, right-axis keys) of ``spec`` that were logged."""
    logged = sorted({k for m in metrics.values() for k in m})
    left = [k for k in spec.keys if k in logged]
    if spec.prefixes:
        left += [k for k in logged if k.startswith(spec.prefixes) and k not in left and k not in spec.right]
    right = [k for k in spec.right if k in logged]
    return left, right


# ------------------------------------------------------------------------------------ plotting
def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_plots(metrics: Metrics, out_dir: str | Path) -> list[Path]:
    """One PNG per ``PLOTS`` entry whose metrics were logged; returns the paths written."""
    from matplotlib.figure import Figure  # the object API: no pyplot global state, no GUI backend

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in PLOTS:
        left, right = plot_keys(spec, metrics)
        if not left and not right:
            continue
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.subplots()
        _draw(ax, spec, metrics, left, right)
        path = out_dir / f"{spec.name}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def _draw(ax, spec: PlotSpec, metrics: Metrics, left: list[str], right: list[str]) -> None:
    from matplotlib.ticker import MaxNLocator

    if spec.stacked and left:
        steps = [s for s, m in metrics.items() if any(k in m for k in left)]
        values = [[_finite_or_zero(metrics[s].get(k)) for s in steps] for k in left]
        ax.stackplot(steps, values, labels=[k.removeprefix("timing_s/") for k in left], alpha=0.8)
    else:
        for key in left:
            ax.plot(*series(metrics, key), marker=".", label=key)
    axes = [ax]
    if right:
        twin = ax if spec.stacked else ax.twinx()  # a total drawn over its stacked parts shares the axis
        for key in right:
            twin.plot(*series(metrics, key), color="black", linestyle="--", label=key)
        axes.append(twin)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(spec.title)
    ax.grid(alpha=0.3)
    handles = [h for a in dict.fromkeys(axes) for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, fontsize="small", loc="best")


def _finite_or_zero(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else 0.0


# ------------------------------------------------------------------------------------- report
def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def metrics_table(metrics: Metrics, keys: list[str]) -> list[str]:
    """Markdown rows: metric, its first and last logged (finite) values with their steps, change.
    Per metric, because validation metrics are logged only every ``test_freq`` steps."""
    rows = ["| metric | first | last | change |", "|---|---:|---:|---:|"]
    for key in keys:
        steps, values = series(metrics, key)
        if not steps:
            rows.append(f"| `{key}` | - | - | - |")
            continue
        rows.append(f"| `{key}` | {_fmt(values[0])} (step {steps[0]}) | {_fmt(values[-1])} (step {steps[-1]}) "
                    f"| {_fmt(values[-1] - values[0])} |")
    return rows


def _dump_dirs(config: dict, run_dir: Path) -> list[tuple[str, Path]]:
    """Generation dump folders named in the config (relative ones: cwd first, then the run dir)."""
    trainer = config.get("trainer") or {}
    found = []
    for key in ("rollout_data_dir", "validation_data_dir"):
        value = trainer.get(key)
        if value:
            path = Path(value).expanduser()
            found.append((key, path if path.is_absolute() or path.exists() else run_dir / path))
    return found


def sample_section(config: dict, run_dir: Path, count: int) -> list[str]:
    lines = ["## Sample generations", ""]
    dumps = [(key, found) for key, folder in _dump_dirs(config, run_dir) if (found := latest_dump(folder))]
    if not dumps:
        return lines + ["No generation dump found (set `trainer.rollout_data_dir` or "
                        "`trainer.validation_data_dir` to record samples).", ""]
    for key, (step, path) in dumps:
        lines += [f"### `{key}` step {step} (`{path}`)", ""]
        for i, record in enumerate(read_jsonl(path, limit=count)):
            prompt = record.get("input", record.get("prompt", ""))
            response = record.get("output", record.get("response", ""))
            lines += [f"**sample {i}**, score {_fmt(_maybe_float(record.get('score')))}", "",
                      "```text", f"{prompt}", "--- response ---", f"{response}", "```", ""]
    return lines


def _maybe_float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def write_report(run_dir: str | Path, metrics: Metrics, plots: list[Path], samples: int = 3,
                 note: str | None = None) -> Path:
    """``<run_dir>/report.md`` (see the module docstring); ``note`` is printed under the curves."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text() if config_path.is_file() else ""
    config = (yaml.safe_load(config_text) or {}) if config_text else {}
    steps = list(metrics)
    lines = [f"# Run report: {run_dir.name}", "",
             f"Steps {steps[0]} to {steps[-1]} ({len(steps)} logged) from `{run_dir / 'metrics.jsonl'}`.", "",
             "## Curves", ""]
    lines += [f"![{p.stem}]({p.relative_to(run_dir) if p.is_relative_to(run_dir) else p})" for p in plots]
    lines += [note or "", "", "## Metrics: first and last step", ""]
    logged = sorted({k for m in metrics.values() for k in m})
    key_rows = [k for k in KEY_METRICS if k in logged] + [k for k in logged if k.startswith("val-core/")]
    lines += metrics_table(metrics, key_rows) + ["", "<details><summary>all metrics</summary>", ""]
    lines += metrics_table(metrics, logged) + ["", "</details>", ""]
    lines += sample_section(config, run_dir, samples)
    lines += ["## Config", ""]
    lines += (["<details><summary>config.yaml</summary>", "", "```yaml", config_text.rstrip(), "```", "",
               "</details>"] if config_text else [f"No `{config_path}` found."])
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridrl plot", description="plot a run's metrics and write report.md")
    parser.add_argument("run_dir", help="folder with metrics.jsonl (trainer.default_local_dir)")
    parser.add_argument("--samples", type=int, default=3, help="generations shown per dump in the report")
    parser.add_argument("--no-plots", action="store_true", help="write only report.md")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = Path(args.run_dir)
    source = run_dir / "metrics.jsonl"
    if not source.is_file():
        print(f"hybridrl plot: {source} does not exist; the run must log with trainer.logger=[file]", file=sys.stderr)
        return 2
    try:
        metrics = read_metrics(source)
    except ValueError as err:
        print(f"hybridrl plot: {err}", file=sys.stderr)
        return 2
    if not metrics:
        print(f"hybridrl plot: {source} has no records", file=sys.stderr)
        return 2
    plots, note = [], None
    if args.no_plots:
        note = "(curves not drawn: --no-plots)"
    elif has_matplotlib():
        plots = write_plots(metrics, run_dir / "plots")
    else:
        note = "(curves not drawn: matplotlib is missing; `pip install 'hybridrl[plot]'`)"
        print(f"hybridrl plot: {note}", file=sys.stderr)
    report = write_report(run_dir, metrics, plots, args.samples, note)
    print(f"hybridrl plot: wrote {len(plots)} plot(s) under {run_dir / 'plots'} and {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

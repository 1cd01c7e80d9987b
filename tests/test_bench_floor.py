"""benchmarks/floor.py: the floor of a step split over ranks that run at once (issue 10)."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from floor import Machine, ModelShape, cpu_description, step_floor  # noqa: E402

SHAPE = ModelShape(matmul_params=600_000, attn_dim=3 * 128, weight_bytes=2_400_000, params=720_000)
MACHINE = Machine(peak_flops=200e9, bandwidth=40e9)


@pytest.mark.parametrize("with_ref", [False, True])
def test_ranks_split_the_rows_and_add_their_rates(with_ref):
    whole = step_floor(SHAPE, MACHINE, 16, 8, 14.0, 64, with_ref)
    two = step_floor(SHAPE, MACHINE, 16, 8, 14.0, 64, with_ref, ranks=2)
    half = step_floor(SHAPE, MACHINE, 8, 8, 14.0, 64, with_ref)
    # each rank does half the rows at one rank's rate, at the same time as the other
    assert two["seconds"] == half["seconds"] and two["total_s"] == half["total_s"]
    assert two["total_s"] < whole["total_s"]
    # the work is the whole step's, measured against both ranks' rate: MFU = flops / (time x peak)
    assert two["update_flops"] == pytest.approx(whole["update_flops"])
    assert two["flops"] == pytest.approx(whole["flops"])
    assert (two["peak_flops"], whole["peak_flops"]) == (2 * MACHINE.peak_flops, MACHINE.peak_flops)
    assert two["update_flops"] / two["peak_flops"] == pytest.approx(two["seconds"]["update_actor"])


def test_ranks_below_one_are_refused():
    with pytest.raises(ValueError, match="ranks must be at least 1"):
        step_floor(SHAPE, MACHINE, 16, 8, 14.0, 64, False, ranks=0)


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw

processor\t: 1
model name\t: AMD EPYC
"""


def test_cpu_description_names_the_generation_numbers_and_vector_instructions(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert cpu_description(CPUINFO) == "AMD EPYC (family 25, model 17), AVX-512, 2 CPUs"
    avx2 = CPUINFO.replace(" avx512f avx512bw", "").replace("model\t\t: 17", "model\t\t: 1")
    assert cpu_description(avx2) == "AMD EPYC (family 25, model 1), AVX2 + FMA, 2 CPUs"
    assert cpu_description(CPUINFO.replace("avx2 fma avx512f avx512bw", "sse4_2")).endswith("model 17), no AVX2, 2 CPUs")


def test_the_measured_machine_records_its_cpu(monkeypatch):
    import floor

    reps_seen = []

    def peak(reps: int = 20) -> float:  # the rates are measured elsewhere
        reps_seen.append(reps)
        return 1e11

    monkeypatch.setattr(floor, "measure_peak_flops", peak)
    monkeypatch.setattr(floor, "measure_bandwidth", lambda: 3e10)
    assert Machine.measure() == Machine(peak_flops=1e11, bandwidth=3e10, cpu=cpu_description(), peak_of=floor.PEAK_OF)
    Machine.measure(peak_reps=10)
    assert reps_seen == [20, 10]
    assert Machine(peak_flops=1.0, bandwidth=1.0).cpu == ""  # records written before the field load as before
    assert Machine(peak_flops=1.0, bandwidth=1.0).ranks == 1
    assert Machine(peak_flops=1.0, bandwidth=1.0).peak_of == "square"  # what records before the field measured


def test_the_peak_is_the_fastest_product_at_its_best_run():
    """A peak is an upper bound: the highest rate of any product, each at its fastest run."""
    import floor

    now = [0.0]
    durations = {"square": [0.01, 0.1, 0.2], "narrow": [0.05, 0.06, 0.04]}  # the untimed run, then two reps

    def product(name):
        def run():
            now[0] += durations[name].pop(0)
        return run

    rate = floor.best_rate([(2e9, product("square")), (1e9, product("narrow"))], reps=2, clock=lambda: now[0])
    # the narrow product's best run, 1e9 / 0.04 s, beats the square's 2e9 / 0.1 s (its untimed warm-up
    # run is not counted)
    assert rate == pytest.approx(2.5e10)
    assert durations == {"square": [], "narrow": []}


def test_the_peak_times_the_square_and_the_update_s_inner_products(monkeypatch):
    import floor

    monkeypatch.setattr(floor, "PEAK_PRODUCTS", ((8, 4, 2),))
    products = floor.peak_products(size=16)
    from hybridrl.utils.cpu_matmul import onednn_available

    backends = 2 if onednn_available() else 1
    # the square, then the inner product with its weight as stored and transposed, through each backend
    assert [flops for flops, _ in products] == [2 * 16**3] * backends + [2 * 8 * 4 * 2] * 2 * backends
    assert all(tuple(run().shape) in ((16, 16), (8, 2)) for _, run in products)
    assert floor.measure_peak_flops(size=16, reps=1) > 0


def test_several_ranks_are_measured_at_once(monkeypatch):
    """Ranks share caches, memory and the chip: their rate is measured with all of them running."""
    import floor

    calls = []

    def together(ranks, threads, peak_reps=20):
        calls.append((ranks, threads, peak_reps))
        return 3.6e10, 1.2e10

    monkeypatch.setattr(floor, "measure_rates_together", together)
    machine = Machine.measure(peak_reps=10, ranks=2)
    assert machine == Machine(peak_flops=3.6e10, bandwidth=1.2e10, cpu=cpu_description(), ranks=2,
                              peak_of=floor.PEAK_OF)
    assert calls == [(2, torch.get_num_threads(), 10)]


def test_rates_measured_together_come_from_separate_processes():
    from floor import measure_rates_together

    peak, bandwidth = measure_rates_together(2, threads=1, peak_reps=2, size=128, megabytes=8)
    assert peak > 1e8 and bandwidth > 1e8


def test_rollout_roofline_of_one_new_token_is_the_prefill_alone():
    from rollout_bench import roofline

    shape = {"layer_params": 500_000, "head_params": 130_000, "attn_dim": 384, "weight_bytes": 2_520_000}
    prefill_flops, prefill_s = roofline(shape, 32, 64, 1, 100e9, 30e9)
    # 32 prompts of 64 tokens through the layers, the head on each prompt's last position, causal attention
    assert prefill_flops == 32 * (2 * 500_000 * 64 + 2 * 130_000) + 32 * 4 * 384 * 64 * 65 / 2
    assert prefill_s == max(prefill_flops / 100e9, 2_520_000 / 30e9)
    flops, seconds = roofline(shape, 32, 64, 3, 100e9, 30e9)
    steps = [32 * (2 * 630_000 + 4 * 384 * (64 + step)) for step in (1, 2)]  # the two decode steps
    assert flops == pytest.approx(prefill_flops + sum(steps))
    assert seconds == pytest.approx(prefill_s + sum(max(f / 100e9, 2_520_000 / 30e9) for f in steps))


def test_machine_key_names_amd_generations_and_falls_back_to_the_numbers(monkeypatch):
    from floor import machine_key

    monkeypatch.delenv("HYBRIDRL_BENCH_MACHINE", raising=False)
    assert machine_key(CPUINFO) == "zen4"  # family 25, model 17: Genoa, where the family alone says Zen 3 too
    assert machine_key(CPUINFO.replace("model\t\t: 17", "model\t\t: 1")) == "zen3"
    assert machine_key(CPUINFO.replace("cpu family\t: 25", "cpu family\t: 26").replace("model\t\t: 17", "model\t\t: 2")) == "zen5"
    intel = CPUINFO.replace("AuthenticAMD", "GenuineIntel").replace("cpu family\t: 25", "cpu family\t: 6")
    assert machine_key(intel) == "intel-f6-m17"
    assert machine_key("processor\t: 0\n") not in ("", "zen4")  # no numbers: the architecture
    monkeypatch.setenv("HYBRIDRL_BENCH_MACHINE", "laptop")
    assert machine_key(CPUINFO) == "laptop"


def test_results_go_to_the_machine_s_own_folder(monkeypatch, tmp_path):
    from floor import provenance, results_dir

    monkeypatch.setenv("HYBRIDRL_BENCH_MACHINE", "zen9")
    assert results_dir(tmp_path) == tmp_path / "zen9"
    assert results_dir().parts[-3:] == ("benchmarks", "results", "zen9")
    day, _, commit = provenance().partition(" at ")
    assert len(day) == 10 and day[4] == day[7] == "-"
    assert len(commit.rstrip("+")) >= 7  # the checkout's commit (tests run in a git clone)


def test_provenance_names_the_code_a_run_started_with(monkeypatch):
    """A run that takes half an hour is labelled with the commit it started from, not one made while
    it measured: the first answer is kept for the process."""
    import floor

    def no_git(*args, **kwargs):
        raise OSError("git is gone")

    floor.provenance.cache_clear()
    try:
        first = floor.provenance()
        monkeypatch.setattr(floor.subprocess, "run", no_git)
        assert floor.provenance() == first  # not looked up again
        floor.provenance.cache_clear()
        assert floor.provenance() == first.partition(" at ")[0]  # looked up again: no commit, the day alone
    finally:
        floor.provenance.cache_clear()


def test_a_row_is_held_to_the_machine_s_rates_during_its_runs():
    """grpo_bench measures the machine before each run of a row and its floor takes the medians: a
    shared machine's speed drifts by a fifth within an hour, and one measurement at the start of a
    file held the rows run later to a floor that far off."""
    import grpo_bench

    samples = [Machine(43.7e9, 16.9e9, "cpu"), Machine(35.9e9, 12.6e9, "cpu"), Machine(40e9, 14e9, "cpu")]
    assert grpo_bench.machine_during(samples) == Machine(40e9, 14e9, "cpu")
    assert grpo_bench.machine_during(samples[:2]).peak_flops == pytest.approx(39.8e9)
    two_ranks = [Machine(36.5e9, 12e9, "cpu", 2), Machine(37.1e9, 13e9, "cpu", 2)]
    assert grpo_bench.machine_during(two_ranks).ranks == 2


def test_each_run_is_held_to_the_rates_measured_just_before_it():
    """A row's floor takes the median of the rates measured before its runs; each run's own fraction
    of the floor and update MFU use the rates measured just before that run, in the order they ran,
    so the report can show how far the row's figures move with the machine's rate (a Xeon's two
    measurements of one row read 213 and 191 GFLOP/s)."""
    import grpo_bench

    fast, slow = Machine(213e9, 14e9, "cpu"), Machine(191e9, 12e9, "cpu")
    floors = [step_floor(SHAPE, m, 16, 8, 14.0, 64, False) for m in (fast, slow)]

    def step(total: float, update: float) -> dict:
        return {"timing_s/step": total, "timing_s/gen": total - update, "timing_s/update_actor": update}

    hyb = [step(0.50, 0.35), step(0.52, 0.36), step(0.60, 0.40), step(0.58, 0.42)]
    runs = grpo_bench.run_fractions(hyb, floors)
    assert runs["floor_frac_runs"] == pytest.approx([floors[0]["total_s"] / 0.51, floors[1]["total_s"] / 0.59])
    assert runs["update_mfu_runs"] == pytest.approx([floors[0]["update_flops"] / 0.355 / 213e9,
                                                     floors[1]["update_flops"] / 0.41 / 191e9])
    # the faster measurement holds its run to a nearer floor
    assert floors[0]["total_s"] < floors[1]["total_s"]
    # steps that do not split evenly into the runs give nothing rather than a wrong share
    assert grpo_bench.run_fractions(hyb[:3], floors) == {} and grpo_bench.run_fractions([], floors) == {}
    # a run without an update (a row that only generates) has no MFU
    no_update = grpo_bench.run_fractions([step(0.5, 0.0), step(0.5, 0.0), step(0.6, 0.4), step(0.6, 0.4)], floors)
    assert no_update["update_mfu_runs"] is None and len(no_update["floor_frac_runs"]) == 2


def test_trl_runs_at_its_own_thread_count_and_the_driver_s_comes_back(monkeypatch):
    import grpo_bench

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    args = grpo_bench.argparse.Namespace(threads=1, trl_threads=0)
    assert grpo_bench.trl_threads(args) == 1  # 0: the frameworks' shared --threads
    args.trl_threads = 2
    with grpo_bench.threads_for(grpo_bench.trl_threads(args)):
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    assert torch.get_num_threads() == before and os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    with pytest.raises(RuntimeError, match="TRL failed"), grpo_bench.threads_for(2):
        raise RuntimeError("TRL failed")
    assert torch.get_num_threads() == before and "OMP_NUM_THREADS" not in os.environ


def test_an_eos_run_reports_how_mixed_its_lengths_were():
    import grpo_bench

    steps = [{"prompt_length/min": 30.0, "prompt_length/mean": 35.0, "prompt_length/max": 40.0,
              "response_length/min": 10.0, "response_length/mean": 50.0 + i, "response_length/max": 100.0,
              "perf/total_num_tokens": 1360.0} for i in range(3)]
    out = grpo_bench.mixed_lengths(steps, rows=16)
    assert out["response_length_mean"] == 51.0 and out["prompt_length_max"] == 40.0
    assert out["padded_efficiency"] == pytest.approx(1360 / (16 * 140))
    with pytest.raises(SystemExit):  # TRL's tokens would no longer match hybridrl's
        grpo_bench.main(["--case", "tiny", "--eos"])

"""NaN/Inf in rewards, advantages, loss or gradients: found, reported with step/phase/rank, and
handled by trainer.nan_policy (stop: a clear error; skip: no update applied, training/skipped_steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reliability_helpers import LOCAL, config, make_assets, read_metrics
from safetensors.torch import load_file

from hybridrl.single_controller.errors import WorkerError
from hybridrl.trainer.main_ppo import run
from hybridrl.utils.faults import ENV
from hybridrl.utils.numerics import (
    NonFiniteError,
    check_batch,
    check_update,
    nonfinite_summary,
    screen_update,
)


def _batch(**values):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return {"response_mask": mask, **values}


def test_check_batch_names_column_phase_and_position():
    fine = torch.zeros(2, 3)
    assert check_batch(_batch(advantages=fine, token_level_scores=fine), step=7, policy="stop")
    # a NaN under the mask (padding) does not count
    padded = torch.tensor([[0.0, 0.0, float("nan")], [0.0, 0.0, 0.0]])
    assert check_batch(_batch(advantages=padded), step=7, policy="stop")
    bad = torch.tensor([[0.0, 0.0, 0.0], [float("inf"), 0.0, 0.0]])
    with pytest.raises(NonFiniteError) as info:
        check_batch(_batch(token_level_scores=bad, advantages=bad * 0), step=7, policy="stop")
    err = info.value
    assert (err.step, err.phase, err.rank) == (7, "reward", "driver")
    assert "token_level_scores: 1 of 3 non-finite (first at row 1, col 0: inf)" in str(err)
    assert "advantages: 1 of 3" in str(err) and "trainer.nan_policy=skip" in str(err)
    assert check_batch(_batch(advantages=bad), step=7, policy="skip") is False


def test_check_update_and_screen_update():
    good = {"loss": 0.5, "grad_norm": 1.0}
    assert check_update(good, {"pg_loss": 0.1}, step=3, phase="update_actor", rank=1, policy="stop")
    with pytest.raises(NonFiniteError, match=r"step 3 in phase update_actor on rank 1: .*this rank's pg_loss=nan"):
        check_update({"loss": float("nan"), "grad_norm": float("nan")}, {"pg_loss": float("nan")},
                     step=3, phase="update_actor", rank=1, policy="stop")
    out = {"actor/pg_loss": float("nan"), "actor/lr": 1e-3}
    screened = screen_update(out, {"loss": float("nan"), "grad_norm": float("nan")}, {}, role="actor", step=3,
                             rank=0, policy="skip")
    assert screened == {"actor/lr": 1e-3, "actor/skipped_updates": 1.0}
    assert nonfinite_summary("x", torch.tensor([1.0, float("-inf")])) == "x: 1 of 2 non-finite (first at row 1: -inf)"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("nan_assets"))


@pytest.mark.e2e
def test_nan_loss_with_stop_ends_the_run_naming_step_phase_and_rank(assets, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "update_actor:nan")
    cfg = config(assets, tmp_path / "stop", **LOCAL, **{"trainer.nan_policy": "stop", "trainer.total_training_steps": 1})
    with pytest.raises(WorkerError) as info:
        run(cfg)
    text = str(info.value)
    assert "NonFiniteError" in text and "update_actor" in text
    assert "non-finite values at step 1 in phase update_actor on rank 0" in text and "grad_norm=nan" in text
    assert not (tmp_path / "stop" / "global_step_1").exists()


def _run_with_skip(assets, run_dir, monkeypatch, fault):
    """Two steps under nan_policy=skip with ``fault``; the metrics, after checking that the exported
    weights equal the initial ones and both steps count as skipped."""
    monkeypatch.setenv(ENV, fault)
    cfg = config(assets, run_dir, **LOCAL, **{
        "trainer.nan_policy": "skip", "trainer.save_freq": 2,
        "actor_rollout_ref.actor.checkpoint.save_contents": "[model,optimizer,extra,hf_model]"})
    run(cfg)
    metrics = read_metrics(run_dir)
    assert [metrics[s]["training/skipped_steps"] for s in (1, 2)] == [1.0, 2.0]
    before = load_file(str(next(Path(assets["model"]).glob("*.safetensors"))))
    after = load_file(str(run_dir / "global_step_2" / "actor" / "hf_model" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before if k in after), "a skipped update changed weights"
    return metrics


@pytest.mark.e2e
def test_nan_loss_with_skip_applies_no_update_and_counts_it(assets, tmp_path, monkeypatch):
    metrics = _run_with_skip(assets, tmp_path / "skip", monkeypatch, "update_actor:nan")
    assert metrics[2]["actor/skipped_updates"] == 2.0  # 4 prompts / mini-batches of 2: both skipped
    assert "actor/pg_loss" not in metrics[2]  # no NaN metric logged for the skipped updates


@pytest.mark.e2e
@pytest.mark.parametrize("phase", ["compute_log_prob", "compute_ref_log_prob"])
def test_nan_log_probs_sent_with_the_update_stop_the_run_before_it_applies(assets, tmp_path, monkeypatch, phase):
    """The update goes out with the log-prob calls and takes their outputs on the ranks
    (PPOTrainer.update_with_log_probs); NaN log-probs must still end a nan_policy=stop run with the
    driver's error naming the phase, and the update must not apply."""
    monkeypatch.setenv(ENV, f"{phase}:nan")
    cfg = config(assets, tmp_path / "stop", **LOCAL, **{"trainer.nan_policy": "stop", "trainer.total_training_steps": 1})
    with pytest.raises(NonFiniteError) as info:
        run(cfg)
    assert (info.value.step, info.value.phase, info.value.rank) == (1, phase, "driver")


@pytest.mark.e2e
def test_nan_ref_log_probs_with_skip_apply_no_update_and_count_it(assets, tmp_path, monkeypatch):
    metrics = _run_with_skip(assets, tmp_path / "skip", monkeypatch, "compute_ref_log_prob:nan")
    assert "actor/pg_loss" not in metrics[2] and "actor/lr" not in metrics[2]  # the update did nothing

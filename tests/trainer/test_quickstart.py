"""`hybridrl quickstart` end to end at a few steps: data, tiny model, SFT, GRPO on Ray, greedy eval."""

import pytest

from hybridrl.trainer import quickstart

pytestmark = [pytest.mark.e2e]


def test_quickstart_pipeline_runs_and_reports(tmp_path, ray_session, capsys):
    out = tmp_path / "qs"
    assert quickstart.main(["--out", str(out), "--sft-steps", "5", "--grpo-steps", "2", "--workers", "2",
                            "trainer.test_freq=2"]) == 0
    printed = capsys.readouterr().out
    assert "validation accuracy on held-out prompts" in printed and "greedy accuracy" in printed
    assert (out / "sft" / "hf_model" / "config.json").exists()
    assert (out / "grpo" / "metrics.jsonl").exists() and (out / "grpo" / "global_step_2").is_dir()
    assert (out / "eval_grpo" / "results.json").exists()

"""``hybridrl plot`` on a synthetic run directory, and the generation-dump helpers."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from hybridrl.models import load_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.trainer import plot
from hybridrl.trainer.dumps import decode_generations, dump_batch, dump_generations, latest_dump, read_jsonl

PNGS = {"score", "response_length", "entropy", "kl", "grad_norm", "timing"}


def _record(step: int, score: float) -> dict:
    return {"step": step, "critic/score/mean": score, "response_length/mean": 10.0 + step,
            "response_length/clip_ratio": 0.1 * step, "actor/entropy": 2.0 - 0.1 * step,
            "actor/kl_loss": 0.01 * step, "actor/ppo_kl": 0.001 * step, "actor/grad_norm": 1.0 / step,
            "timing_s/gen": 1.0, "timing_s/update_actor": 2.0, "timing_s/step": 3.5}


@pytest.fixture
def run_dir(tmp_path):
    """Steps 1-4; step 3 logged twice (a resume: the second wins); validation on steps 2 and 4."""
    records = [_record(1, 0.1), _record(2, 0.2), _record(3, 0.9), _record(3, 0.3), _record(4, 0.4)]
    records[1]["val-core/hybridrl/addition/acc/mean@1"] = 0.25
    records[4]["val-core/hybridrl/addition/acc/mean@1"] = 0.5
    records[0]["actor/grad_norm"] = "nan"  # the file backend writes non-finite values as strings
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dumps = tmp_path / "rollouts"
    for step in (2, 4):
        dump_generations(dumps, step, [f"prompt {step}a", f"prompt {step}b"], [f"answer {step}a", f"answer {step}b"],
                         [1.0, 0.0], {"acc": [True, False]})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"rollout_data_dir": str(dumps),
                                                                      "total_training_steps": 4}}))
    return tmp_path


def test_read_metrics_last_record_of_a_step_wins(run_dir):
    metrics = plot.read_metrics(run_dir / "metrics.jsonl")
    assert list(metrics) == [1, 2, 3, 4]
    assert metrics[3]["critic/score/mean"] == 0.3
    assert math.isnan(metrics[1]["actor/grad_norm"])
    assert plot.series(metrics, "val-core/hybridrl/addition/acc/mean@1") == ([2, 4], [0.25, 0.5])
    assert plot.series(metrics, "actor/grad_norm")[0] == [2, 3, 4]  # non-finite points are not drawn


def test_read_metrics_names_a_bad_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 2, "a": [1]}\n')
    with pytest.raises(ValueError, match=r"line 2 key 'a'"):
        plot.read_metrics(tmp_path / "metrics.jsonl")


def test_plot_writes_pngs_and_report(run_dir):
    pytest.importorskip("matplotlib")
    assert plot.main([str(run_dir)]) == 0
    written = {p.stem for p in (run_dir / "plots").glob("*.png")}
    assert written == PNGS
    for name in PNGS:
        assert (run_dir / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (run_dir / "report.md").read_text()
    assert all(f"![{name}](plots/{name}.png)" in report for name in PNGS)


def test_report_without_matplotlib_has_tables_samples_and_config(run_dir, monkeypatch):
    monkeypatch.setattr(plot, "has_matplotlib", lambda: False)
    assert plot.main([str(run_dir), "--samples", "1"]) == 0
    assert not (run_dir / "plots").exists()
    report = (run_dir / "report.md").read_text()
    assert "matplotlib is missing" in report and "![" not in report
    assert "| metric | first | last | change |" in report
    assert "| `critic/score/mean` | 0.1 (step 1) | 0.4 (step 4) | 0.3 |" in report
    assert "| `val-core/hybridrl/addition/acc/mean@1` | 0.25 (step 2) | 0.5 (step 4) | 0.25 |" in report
    assert "| `actor/grad_norm` | 0.5 (step 2) | 0.25 (step 4) | -0.25 |" in report  # nan at step 1 skipped
    assert "`rollout_data_dir` step 4" in report and "answer 4a" in report
    assert "answer 4b" not in report and "answer 2a" not in report  # --samples 1, newest dump only
    assert "total_training_steps: 4" in report


def test_plot_without_metrics_file_fails_clearly(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert "trainer.logger=[file]" in capsys.readouterr().err


def test_dump_generations_layout_and_checks(tmp_path):
    path = dump_generations(tmp_path, 7, ["p"], ["r"], [torch.tensor(0.5)], {"acc": [float("nan")]})
    assert path == tmp_path / "7.jsonl"
    assert read_jsonl(path) == [{"input": "p", "output": "r", "score": 0.5, "acc": "nan", "step": 7}]
    assert latest_dump(tmp_path) == (7, path) and latest_dump(tmp_path / "absent") is None
    with pytest.raises(ValueError, match="different lengths"):
        dump_generations(tmp_path, 8, ["p", "q"], ["r"], [1.0, 0.0])


def test_decode_and_dump_batch(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    prompt, response = tok("12+30=")["input_ids"], tok("42")["input_ids"] + [tok.eos_token_id]
    p, r = len(prompt) + 2, len(response) + 3
    prompts = torch.tensor([[tok.pad_token_id] * 2 + prompt])
    responses = torch.tensor([response + [tok.pad_token_id] * 3])
    mask = torch.tensor([[0, 0] + [1] * (len(prompt) + len(response)) + [0, 0, 0]])
    batch = DataProto.from_dict(tensors={"prompts": prompts, "responses": responses, "attention_mask": mask,
                                         "response_mask": mask[:, p:]})
    assert responses.shape[1] == r
    assert decode_generations(tok, batch) == (["12+30="], ["42"])
    batch.batch["token_level_scores"] = torch.zeros(1, r)
    batch.batch["token_level_scores"][0, :2] = torch.tensor([0.5, 0.25])
    path = dump_batch(tmp_path, 3, tok, batch, {"acc": [True]})
    assert read_jsonl(path) == [{"input": "12+30=", "output": "42", "score": 0.75, "acc": True, "step": 3}]

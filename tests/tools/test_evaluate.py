"""``hybridrl eval`` end to end on the tiny model: output files, keys, custom rewards, checkpoints."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from hybridrl.cli import main as cli_main
from hybridrl.engine import TrainEngine
from hybridrl.model_merger import save_checkpoint_metadata
from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.trainer.evaluate import main

SOURCE = "hybridrl/addition"


def _run(model, data, out, *extra) -> tuple[dict, list[dict]]:
    args = ["eval", "--model", str(model), "--data", str(data), "--max-new-tokens", "6", "--limit", "4",
            "--batch-size", "3", "--out", str(out), *extra]
    assert cli_main(args) == 0
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return results, samples


def test_sampled_eval_writes_results_and_samples(tiny_model_dir, addition_parquet, tmp_path, capsys):
    results, samples = _run(tiny_model_dir, addition_parquet, tmp_path / "out", "--n", "2", "--temperature", "1.0")
    assert results["sampling"] == {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6,
                                   "greedy": False, "seed": 0}
    assert set(results["metrics"]) == {SOURCE, "all"}
    keys = {f"{kind}/{agg}@2" for kind in ("strict", "lenient") for agg in ("mean", "maj", "best")}
    keys |= {"prompts", "samples", "response_length/mean", "response_length/clip_ratio"}
    assert set(results["metrics"][SOURCE]) == keys
    assert results["metrics"][SOURCE]["prompts"] == 4 and results["metrics"][SOURCE]["samples"] == 8
    # 4 prompts over batches of 3 + 1, two samples each, in order
    assert [(s["index"], s["sample"]) for s in samples] == [(i, g) for i in range(4) for g in range(2)]
    rows = pq.read_table(addition_parquet).to_pylist()
    for s in samples:
        assert s["data_source"] == SOURCE and s["ground_truth"] == rows[s["index"]]["reward_model"]["ground_truth"]
        assert rows[s["index"]]["prompt"][0]["content"] in s["prompt"] and s["prompt"].startswith("<|im_start|>")
        assert 1 <= s["length"] <= 6 and s["score"] in (0.0, 1.0)
    mean_len = sum(s["length"] for s in samples) / len(samples)
    assert results["metrics"][SOURCE]["response_length/mean"] == pytest.approx(mean_len)
    assert "strict/mean@2" in capsys.readouterr().out


def test_custom_reward_function_scores_every_sample(tiny_model_dir, addition_parquet, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def even(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': float(extra_info['index'] % 2 == 0)}\n")
    results, samples = _run(tiny_model_dir, addition_parquet, tmp_path / "out", "--n", "2",
                            "--reward-function", f"{reward}:even")
    indices = [r["extra_info"]["index"] for r in pq.read_table(addition_parquet).to_pylist()[:4]]
    expected = sum(i % 2 == 0 for i in indices) / 4
    metrics = results["metrics"][SOURCE]
    assert 0 < expected < 1
    assert metrics["strict/mean@2"] == metrics["strict/best@2"] == metrics["strict/maj@2"] == expected
    assert [s["score"] for s in samples] == [float(indices[s["index"]] % 2 == 0) for s in samples]


def test_checkpoint_dir_is_merged_on_the_fly_and_greedy_is_deterministic(tiny_model_dir, addition_parquet,
                                                                         tmp_path):
    engine = TrainEngine(load_causal_lm(tiny_model_dir), lr=1e-3)
    ckpt = tmp_path / "ckpt" / "global_step_1" / "actor"
    engine.save_checkpoint(ckpt)
    save_checkpoint_metadata(ckpt, engine.model, load_tokenizer(tiny_model_dir))
    hf_results, hf_samples = _run(tiny_model_dir, addition_parquet, tmp_path / "hf")
    ck_results, ck_samples = _run(ckpt.parent, addition_parquet, tmp_path / "ck")
    assert hf_results["sampling"]["greedy"] and hf_results["sampling"]["temperature"] == 0.0
    assert [s["response"] for s in ck_samples] == [s["response"] for s in hf_samples]
    assert ck_results["metrics"] == hf_results["metrics"]


def test_bad_model_path_is_a_clear_error(addition_parquet, tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--data", str(addition_parquet)]) == 2
    assert "neither a Hugging Face folder" in capsys.readouterr().err

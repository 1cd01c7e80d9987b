"""Preprocessing: the real GSM8K files into verl's exact schema, MATH from local files, the synthetic
tasks (seeded, test disjoint from train, gold solutions score 1.0) and the command lines."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hybridrl.data import cli
from hybridrl.data.files import DataFileError
from hybridrl.data.preprocess import GSM8K_INSTRUCTION, main, prepare
from hybridrl.data.synthetic import TASKS, generate_splits
from hybridrl.rewards import default_compute_score

ROOT = Path(__file__).resolve().parents[2]
GSM8K_DIR = ROOT / ".." / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="module")
def gsm8k_out(tmp_path_factory):
    if not GSM8K_DIR.is_dir():
        pytest.skip(f"{GSM8K_DIR} is absent (shared data only exists on the development machine)")
    out = tmp_path_factory.mktemp("gsm8k")
    assert cli.main(["prepare", "gsm8k", "--input", str(GSM8K_DIR), "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("split, count", [("train", 7473), ("test", 1319)])
def test_gsm8k_verl_schema(gsm8k_out, split, count):
    table = pq.read_table(gsm8k_out / f"{split}.parquet")
    assert table.num_rows == count
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    raw = [json.loads(line) for line in (GSM8K_DIR / f"{split}.jsonl").read_text().splitlines()]
    rows = table.to_pylist()
    for i in (0, 1, count // 2, count - 1):
        truth = raw[i]["answer"].split("#### ")[1].replace(",", "")
        assert rows[i] == {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": raw[i]["question"] + " " + GSM8K_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": i, "answer": raw[i]["answer"], "question": raw[i]["question"]},
        }
    assert GSM8K_INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    for row in rows:  # every preprocessed row's gold answer scores 1.0 through the default scorer
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(row["data_source"], f"#### {truth}", truth) == 1.0


def test_math_from_local_jsonl(tmp_path):
    src = tmp_path / "raw"
    src.mkdir()
    problems = [
        {"problem": "What is 1/2 + 1/2?", "solution": "We get $\\boxed{1}$."},
        {"problem": "Simplify 2/4.", "solution": "It is \\frac{1}{2}, so \\boxed{\\frac{1}{2}}."},
    ]
    (src / "test.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    paths = prepare("math", tmp_path / "out", input_path=src)
    rows = pq.read_table(paths["test"]).to_pylist()
    assert set(paths) == {"test"}
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1", "\\frac{1}{2}"]
    assert rows[1]["prompt"][0]["content"].endswith("output the final answer within \\boxed{}.")
    assert rows[1]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert default_compute_score(rows[1]["data_source"], "\\boxed{0.5}", rows[1]["reward_model"]["ground_truth"]) == 1.0
    (src / "test.jsonl").write_text(json.dumps({"problem": "x", "solution": "no box"}) + "\n")
    with pytest.raises(DataFileError, match=r"test.jsonl row 0 column 'solution': no \\boxed"):
        prepare("math", tmp_path / "out", input_path=src)
    with pytest.raises(FileNotFoundError, match="no train/test"):
        prepare("math", tmp_path / "out", input_path=tmp_path / "out" / "nothing")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_synthetic_tasks(task):
    splits = generate_splits(task, n_train=400, n_test=100, seed=3)
    assert generate_splits(task, n_train=400, n_test=100, seed=3) == splits
    assert generate_splits(task, n_train=400, n_test=100, seed=4) != splits
    train_prompts = {r["prompt"][0]["content"] for r in splits["train"]}
    assert not train_prompts & {r["prompt"][0]["content"] for r in splits["test"]}
    for row in splits["train"] + splits["test"]:
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        truth, solution = row["reward_model"]["ground_truth"], row["extra_info"]["solution"]
        assert default_compute_score(row["data_source"], solution, truth) == 1.0, row
    if task != "countdown":
        assert max(len(r["prompt"][0]["content"]) for r in splits["train"]) <= 20  # short prompts


def test_synthetic_knobs_and_small_task_space():
    rows = generate_splits("addition", 50, 10, min_digits=4, max_digits=4)["train"]
    assert all(len(op) == 4 for r in rows for op in r["prompt"][0]["content"][:-1].split("+"))
    with pytest.raises(ValueError, match="only .* test prompts distinct"):
        generate_splits("addition", 200, 50, max_digits=1)  # only 100 distinct prompts exist
    with pytest.raises(ValueError, match="alphabet"):
        generate_splits("reverse", 5, 5, alphabet="emoji")


def test_addition_question_style_and_products(tmp_path):
    """The question style (for instruction-tuned models) and ``*`` keep the bare-number answer."""
    rows = generate_splits("addition", 60, 20, min_digits=2, max_digits=2, operator="*", style="question")["train"]
    for row in rows:
        match = re.fullmatch(r"What is (\d+) \* (\d+)\? Reply with only the number\.", row["prompt"][0]["content"])
        assert match, row
        truth = int(match[1]) * int(match[2])
        assert row["reward_model"]["ground_truth"] == row["extra_info"]["solution"] == str(truth)
        assert default_compute_score(row["data_source"], f"{match[1]} * {match[2]} = {truth}", str(truth)) == 0.0  # strict
    with pytest.raises(ValueError, match="operator"):
        generate_splits("addition", 5, 5, operator="-")
    with pytest.raises(ValueError, match="style"):
        generate_splits("addition", 5, 5, style="poem")
    assert main(["addition", "--out", str(tmp_path / "mul"), "--n", "20", "--n-test", "5", "--operator", "mul",
                 "--style", "question"]) == 0
    first = pq.read_table(tmp_path / "mul" / "train.parquet").to_pylist()[0]["prompt"][0]["content"]
    assert " * " in first and first.startswith("What is ")


def test_module_entry_point_and_cli(tmp_path, capsys):
    out = tmp_path / "rev"
    proc = subprocess.run(
        [sys.executable, "-m", "hybridrl.data.preprocess", "reverse", "--out", str(out), "--n", "30", "--n-test", "5",
         "--alphabet", "letters"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "train: 30 rows" in proc.stdout
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert rows[0]["data_source"] == "hybridrl/reverse" and rows[0]["prompt"][0]["content"].startswith("reverse ")
    assert cli.main(["inspect", str(out / "test.parquet")]) == 0
    assert "5 rows" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["sort", "--out", str(tmp_path / "s"), "--max-digits", "3"])
    assert cli.main(["frobnicate"]) == 2

"""Bad input, tried systematically through the real entry point ``hybridrl.trainer.main_ppo.main``.

Each case gives a clear error naming the file / row / key (or the documented fallback), nothing
hangs, and a run folder written earlier (checkpoint, tracker, metrics) is left byte-for-byte as it
was. The table is mirrored in docs/reliability.md.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from reliability_helpers import LOCAL, make_assets, read_metrics, small_overrides

from hybridrl.trainer.checkpoint import commit_checkpoint, staging_dir
from hybridrl.trainer.main_ppo import main

pytestmark = [pytest.mark.e2e]

REWARDS = '''
import math, time
def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("reward bug")
def overflow(data_source, solution_str, ground_truth, extra_info=None):
    return 1e300  # a finite Python float that is inf in float32
def mixed(data_source, solution_str, ground_truth, extra_info=None):
    i = extra_info["index"]
    if i == 0:
        time.sleep(3600)
    if i == 1:
        raise ValueError("reward bug")
    if i == 2:
        return float("nan")
    return "1.0"
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Assets, bad files, and a run folder holding an earlier run's checkpoint and metrics."""
    root = tmp_path_factory.mktemp("bad_inputs")
    a = make_assets(root / "assets")
    bad = root / "bad"
    bad.mkdir()
    table = pq.read_table(a["train"])
    pq.write_table(table.slice(0, 0), bad / "empty.parquet")
    pq.write_table(table.slice(0, 4), bad / "four.parquet")  # extra_info.index 0..3: one batch of 4
    (bad / "garbage.parquet").write_bytes(b"not parquet " * 20)
    pq.write_table(table.drop(["prompt"]), bad / "no_prompt.parquet")
    pq.write_table(table.drop(["reward_model"]), bad / "no_reward_model.parquet")
    (bad / "bad.jsonl").write_text(json.dumps(table.slice(0, 1).to_pylist()[0]) + "\n{not json\n")
    shutil.copytree(a["model"], bad / "no_template")
    (bad / "no_template" / "chat_template.jinja").unlink(missing_ok=True)
    tok = json.loads((bad / "no_template" / "tokenizer_config.json").read_text())
    tok.pop("chat_template", None)
    (bad / "no_template" / "tokenizer_config.json").write_text(json.dumps(tok))
    (bad / "empty_dir").mkdir()
    (bad / "rewards.py").write_text(REWARDS)
    run_dir = root / "run"
    (staging_dir(run_dir, 7) / "weights.bin").write_bytes(b"earlier run" * 100)
    commit_checkpoint(run_dir, 7)
    (run_dir / "metrics.jsonl").write_text('{"step": 7, "critic/score/mean": 0.5}\n')
    return {**a, "bad": bad, "run": run_dir}


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _run_main(env, capsys, **extra) -> tuple[int | None, str]:
    """(exit code or None if it raised, error text); the run folder must be unchanged afterwards."""
    before = _snapshot(env["run"])
    # resume disabled: the cases that reach the workers must fail on their input, not on the stand-in checkpoint
    argv = ["--preset", "grpo_quickstart",
            *small_overrides(env, env["run"], **{**LOCAL, "trainer.resume_mode": "disable", **extra})]
    try:
        code, text = main(argv), capsys.readouterr().err
    except Exception as err:  # the entry point lets non-config errors propagate with their traceback
        code, text = None, f"{type(err).__name__}: {err}"
    after = _snapshot(env["run"])
    # checkpoint files stay in place; a replaced config.yaml is kept under another name
    assert {k: v for k, v in after.items() if k in before and k != "config.yaml"} == \
        {k: v for k, v in before.items() if k != "config.yaml"}, "data written earlier was changed"
    assert set(before.values()) <= set(after.values()), "a file written earlier was lost"
    return code, text


B, M = "{bad}", "{model}"
# (case, overrides, substrings the error must contain); "{bad}" / "{model}" are filled in per run.
CASES = [
    ("data file missing", {"data.train_files": "[/nonexistent/train.parquet]"},
     ["/nonexistent/train.parquet", "not found"]),
    ("empty parquet", {"data.train_files": f"[{B}/empty.parquet]"}, ["empty.parquet", "no rows"]),
    ("not a parquet file", {"data.train_files": f"[{B}/garbage.parquet]"}, ["garbage.parquet", "not a readable parquet"]),
    ("missing prompt column", {"data.train_files": f"[{B}/no_prompt.parquet]"},
     ["no_prompt.parquet row 0", "column 'prompt' is missing"]),
    ("missing reward_model column", {"data.train_files": f"[{B}/no_reward_model.parquet]"},
     ["no_reward_model.parquet row 0", "'reward_model'"]),
    ("malformed jsonl line", {"data.train_files": f"[{B}/bad.jsonl]"}, ["bad.jsonl row 1 (line 2)", "invalid JSON"]),
    ("prompt longer than the limit", {"data.max_prompt_length": 3},
     ["train.parquet row", "longer than max_prompt_length=3", "truncation"]),
    ("tokenizer without chat template", {"actor_rollout_ref.model.path": f"{B}/no_template"},
     ["no_template", "no chat template", "actor_rollout_ref.model.custom_chat_template"]),
    ("model path does not exist", {"actor_rollout_ref.model.path": "/nonexistent/model"},
     ["actor_rollout_ref.model.path=/nonexistent/model", "no such folder"]),
    ("model folder without config.json", {"actor_rollout_ref.model.path": f"{B}/empty_dir"},
     ["actor_rollout_ref.model.path=", "empty_dir", "no config.json"]),
    ("config key typo", {"actor_rollout_ref.actor.ppo_mini_batch_sizee": 2},
     ["unknown key actor_rollout_ref.actor.ppo_mini_batch_sizee", "did you mean actor_rollout_ref.actor.ppo_mini_batch_size"]),
    ("contradictory batch sizes", {"actor_rollout_ref.actor.ppo_mini_batch_size": 8},
     ["data.train_batch_size=4 is smaller than actor_rollout_ref.actor.ppo_mini_batch_size=8"]),
    ("value not allowed", {"algorithm.adv_estimator": "grpoo"}, ["algorithm.adv_estimator='grpoo' is not allowed", "grpo"]),
    ("reward file missing", {"custom_reward_function.path": "/nonexistent/reward.py"},
     ["custom_reward_function.path", "/nonexistent/reward.py"]),
    ("reward function name missing", {"custom_reward_function.path": f"{B}/rewards.py", "custom_reward_function.name": "nope"},
     ["custom_reward_function.name", "'nope'", "mixed"]),
    ("run cannot fit in memory", {"data.max_response_length": 1_000_000},
     ["refused to start", "memory preflight", "GiB available", "turn first: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]),
    # these reach the workers: the first reward call fails
    ("reward function raises", {"data.train_files": f"[{B}/four.parquet]", "custom_reward_function.path": f"{B}/rewards.py",
                                "custom_reward_function.name": "raises", "reward.on_error": "fail"},
     ["reward function failed on sample 0", "data_source='hybridrl/addition'", "ValueError: reward bug", "Traceback"]),
    ("reward overflows float32", {"data.train_files": f"[{B}/four.parquet]", "custom_reward_function.path": f"{B}/rewards.py",
                                  "custom_reward_function.name": "overflow", "trainer.nan_policy": "stop"},
     ["non-finite values at step 1 in phase reward on rank driver", "token_level_scores: 8 of"]),
]


def _fill(value, env):
    return value.replace(B, str(env["bad"])).replace(M, env["model"]) if isinstance(value, str) else value


@pytest.mark.parametrize("case, overrides, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_a_clear_error(env, capsys, case, overrides, expected):
    code, text = _run_main(env, capsys, **{k: _fill(v, env) for k, v in overrides.items()})
    assert code != 0, f"{case}: the run did not fail"
    missing = [s for s in expected if s not in text]
    assert not missing, f"{case}: {missing} not in:\n{text[-3000:]}"


def test_failing_rewards_with_on_error_zero_are_scored_zero_and_counted(env, capsys, caplog, tmp_path):
    """hang / raise / NaN / wrong type: each scored 0 and counted, with a warning naming the sample and why."""
    run_dir = tmp_path / "zero"
    argv = ["--preset", "grpo_quickstart", *small_overrides(env, run_dir, **{
        **LOCAL, "data.train_files": f"[{env['bad']}/four.parquet]", "custom_reward_function.path": f"{env['bad']}/rewards.py",
        "custom_reward_function.name": "mixed", "reward.on_error": "zero", "reward.num_workers": 1, "reward.timeout_s": 2,
        "trainer.total_training_steps": 1})]
    with caplog.at_level(logging.WARNING, logger="hybridrl.rewards.manager"):
        assert main(argv) == 0
    step = read_metrics(run_dir)[1]
    assert (step["reward/errors"], step["reward/timeouts"]) == (6.0, 2.0)  # 2 samples per prompt
    logged = caplog.text  # the manager logs the first 5 failures of a batch (the metrics count them all)
    for reason in ("sample 0 (data_source='hybridrl/addition'): timed out after 2 s", "ValueError: reward bug",
                   "returned a non-finite score nan"):
        assert reason in logged, reason

"""One GRPO step with the agent loop through main_ppo (local backend): the trainer passes
extra_info to the rollout, takes its columns back, and logs num_turns/* and tool_call_counts/*."""

import json
import math

from hybridrl.config import load_config
from hybridrl.data.preprocess import prepare
from hybridrl.trainer.main_ppo import run


def test_grpo_step_with_multi_turn_rollout(tmp_path, tiny_model_dir):
    data = prepare("addition", tmp_path / "data", n=16, n_test=4, seed=0, max_digits=2)
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n")
    mt = "actor_rollout_ref.rollout.multi_turn"
    overrides = {
        "data.train_files": f"[{data['train']}]", "data.val_files": f"[{data['test']}]",
        "data.train_batch_size": 4, "data.max_response_length": 24, "data.max_prompt_length": 32,
        "actor_rollout_ref.model.path": str(tiny_model_dir), "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
        f"{mt}.enable": "true", f"{mt}.tool_config_path": str(tools), f"{mt}.max_assistant_turns": 2,
        "trainer.backend": "local", "trainer.n_cpu_workers": 1, "trainer.total_training_steps": 1,
        "trainer.test_freq": 1, "trainer.val_before_train": "false", "trainer.logger": "[file]",
        "trainer.default_local_dir": str(tmp_path / "run"),
    }
    run(load_config([f"{k}={v}" for k, v in overrides.items()], preset="grpo_quickstart"))
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("num_turns/mean", "num_turns/max", "num_turns/min", "tool_call_counts/mean", "actor/pg_loss"):
        assert key in record and math.isfinite(record[key]), key
    assert record["num_turns/min"] >= 2  # at least one assistant turn (+1, verl's count)
    assert "val-core/hybridrl/addition/reward/mean@1" in record

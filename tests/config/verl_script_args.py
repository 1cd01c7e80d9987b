"""Helpers for config tests: read verl run scripts the way bash would pass their arguments."""

import re
import shlex
from pathlib import Path

SCRIPTS = Path(__file__).parent / "verl_scripts"

# Values the scripts' shell variables take (the ones they set themselves, or a user's $HOME).
SHELL_VARS = {
    "HOME": "/home/user",
    "train_files": "['/home/user/data/gsm8k/train.parquet', '/home/user/data/math/train.parquet']",
    "test_files": "['/home/user/data/gsm8k/test.parquet', '/home/user/data/math/test.parquet']",
    "model_path": "Qwen/Qwen2-7B-Instruct",
    "rollout_mode": "async",
    "return_raw_chat": "True",
}


def script_overrides(name: str) -> list[str]:
    """The argv that `python3 -m verl.trainer.main_ppo` receives from the script ``name``."""
    text = (SCRIPTS / name).read_text()
    command = text.split("verl.trainer.main_ppo", 1)[1].replace("\\\n", " ")
    command = re.split(r"\s2>&1|\$@", command)[0]
    command = re.sub(r"\$\{?(\w+)\}?", lambda m: SHELL_VARS[m.group(1)], command)
    return shlex.split(command)

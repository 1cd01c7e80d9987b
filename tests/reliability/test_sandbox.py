"""Sandboxed code rewards: correct code scores 1; loops, bombs, network and escapes are contained and score 0."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hybridrl.rewards import default_compute_score
from hybridrl.rewards.code import compute_score, extract_code
from hybridrl.rewards.sandbox import NOBODY_UID, SandboxLimits, run_sandboxed

FAST = {"wall_s": 4.0, "cpu_s": 1, "memory_mb": 256}
SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def _nobody_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _uid(p) == NOBODY_UID]


def _uid(p: Path) -> int | None:
    try:
        return p.stat().st_uid
    except OSError:
        return None


def test_correct_code_scores_one_through_the_default_router():
    assert default_compute_score("hybridrl/code", SOLUTION, TESTS) == 1.0
    stdio = "Here it is:\n```python\nimport sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n```"
    assert compute_score(stdio, {"inputs": ["1 2\n", "5 5 5\n"], "outputs": ["3\n", "15"]}) == 1.0
    assert compute_score(stdio, '{"inputs": ["1 2"], "outputs": ["4"]}') == 0.0


def test_wrong_code_and_early_exits_score_zero():
    assert compute_score("def add(a, b):\n    return a - b", TESTS) == 0.0
    # skipping the tests by exiting early is not a pass
    assert compute_score("import sys\ndef add(a, b):\n    return 0\nsys.exit(0)", TESTS) == 0.0
    assert compute_score("import os\ndef add(a, b):\n    return 0\nos._exit(0)", TESTS) == 0.0


HOSTILE = {
    "infinite loop": "while True:\n    pass",
    "sleep past the wall clock": "import time\ntime.sleep(60)",
    "memory bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "network connection": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)",
    "output flood": "while True:\n    print('x' * 4096)",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_is_contained_and_scores_zero(name):
    start = time.monotonic()
    code = HOSTILE[name] + "\ndef add(a, b):\n    return a + b\n"
    assert compute_score(code, TESTS, **FAST) == 0.0
    assert time.monotonic() - start < 120  # bounded by the limits, never a hang
    if os.geteuid() == 0:  # the sandbox ran as nobody: none of its processes may outlive it
        deadline = time.monotonic() + 10
        while _nobody_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _nobody_pids() == []


def test_writes_and_deletes_outside_the_sandbox_are_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    shared_tmp = Path("/tmp") / f"hybridrl-sandbox-escape-{os.getpid()}"
    attempts = [
        f"open({str(victim)!r}, 'w').write('gone')",
        f"import os\nos.remove({str(victim)!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"open({str(shared_tmp)!r}, 'w').write('escaped')",  # /tmp is world-writable: the audit hook stops it
        "import subprocess\nsubprocess.run(['rm', '-rf', '/tmp/x'])",
    ]
    for code in attempts:
        result = run_sandboxed(code, SandboxLimits(**FAST))
        assert not result.ok, (code, result)
        assert "PermissionError" in result.stderr, (code, result.stderr[-500:])
    assert victim.read_text() == "keep me"
    assert not shared_tmp.exists()
    inside = run_sandboxed("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())",
                           SandboxLimits(**FAST))
    assert inside.ok and inside.stdout.strip() == "ok", inside


def test_fenced_block_extraction():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("x = 3") == "x = 3"

"""hybridrl.utils.malloc: a training step reuses the memory the previous one freed (glibc)."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# Four update steps of the tiny model at the GRPO benchmark's batch (128 x 78 tokens, 64 of them
# response: (128, 64, 1024) fp32 logits of 33.5 MB, above glibc's largest mmap threshold of 32 MB);
# prints whether the settings applied and each step's page faults.
PROBE = """
import ctypes, json, resource, torch
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: count faults in 4 KB pages on any THP setting
from hybridrl.utils.malloc import keep_freed_memory
applied = keep_freed_memory()
from hybridrl.engine import TrainEngine
from hybridrl.models import build_tiny_model
from hybridrl.protocol import DataProto
torch.set_num_threads(1)
engine = TrainEngine(build_tiny_model("tiny"), lr=1e-3)
ids = torch.randint(3, 1000, (128, 78), generator=torch.Generator().manual_seed(0))
data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                    "responses": ids[:, 14:].clone()})
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.train_step(data, lambda out, micro: (-out["log_probs"].mean(), {}))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([applied, faults]))
"""


LOGITS_PAGES = 128 * 64 * 1024 * 4 // 4096


def _probes(*envs: dict[str, str]) -> list[tuple[bool, list[int]]]:
    """PROBE in one process per environment, run side by side (a process's page faults are its own)."""
    procs = [subprocess.Popen([sys.executable, "-c", PROBE], env={**os.environ, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in envs]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-4000:]
        applied, faults = json.loads(out.strip().splitlines()[-1])
        results.append((applied, faults))
    return results


# The baseline: glibc with its thresholds fixed at their starting values (fixing them turns off the
# dynamic raise), so every block of 128 KB or more is mapped afresh and unmapped on free, and a freed
# heap top goes back to the OS. glibc's plain defaults fall anywhere between that and full reuse,
# depending on what the heap held before (one step of a run measured 5 faults, the next 70k), so
# they make no baseline a test can rely on.
FRESH_PAGES = {"HYBRIDRL_KEEP_FREED_MEMORY": "0", "MALLOC_MMAP_THRESHOLD_": "131072",
               "MALLOC_TRIM_THRESHOLD_": "131072"}


def test_steps_reuse_freed_memory_instead_of_faulting_in_fresh_pages():
    (applied, kept), (opted_out, fresh) = _probes({}, FRESH_PAGES)
    assert applied and not opted_out
    # the baseline faults in every step's logits again: at least their 8192 pages of 4 KB each
    assert min(fresh[1:]) >= LOGITS_PAGES
    # kept: the steps after the first mostly reuse the heap (measured: 5k-16k faults over steps 2-4
    # against 550k; glibc's plain defaults took 96k-195k, so a setting that stops applying fails here)
    assert 10 * sum(kept[1:]) < sum(fresh[1:])

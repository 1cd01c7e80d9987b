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
import json, resource, torch
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


def test_steps_reuse_freed_memory_instead_of_faulting_in_fresh_pages():
    (applied, kept), (opted_out, default) = _probes({}, {"HYBRIDRL_KEEP_FREED_MEMORY": "0"})
    assert applied and not opted_out
    # glibc's defaults map the logits afresh every step: at least their 8192 pages of 4 KB each (more
    # with the other large tensors: 8k-70k measured, depending on what the heap held before)
    assert min(default[1:]) >= LOGITS_PAGES
    # kept: the steps after the first mostly reuse the heap (measured: 17k faults over steps 2-4 vs 159k)
    assert 4 * sum(kept[1:]) < sum(default[1:])

"""Building the C kernels: a change to a local header a source includes rebuilds it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.utils import native_build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
ROOT = Path(__file__).resolve().parents[1]


def test_a_header_change_rebuilds_the_library(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "inc").mkdir()
    header = tmp_path / "inc" / "value.h"
    source = tmp_path / "src" / "kernel.c"
    source.parent.mkdir()
    source.write_text('#include "../inc/value.h"\nint value(void) { return VALUE; }\n')
    header.write_text("#define VALUE 7\n")
    assert native_build.build_library(source, "a test kernel").value() == 7
    header.write_text("#define VALUE 11\n")  # same source file, new header
    assert native_build.build_library(source, "a test kernel").value() == 11
    assert len(list((tmp_path / "cache").glob("kernel_*.so"))) == 2


def test_source_bytes_follow_local_includes_once(tmp_path):
    (tmp_path / "a.h").write_text('#include "b.h"\n#include "a.h"\nA\n')
    (tmp_path / "b.h").write_text('#include "a.h"\nB\n')
    source = tmp_path / "main.c"
    source.write_text('#include <stdint.h>\n#include "a.h"\n  #  include "b.h"\n#include "missing.h"\nMAIN\n')
    text = native_build.source_bytes(source)
    assert text.count(b"MAIN") == 1 and text.count(b"\nA\n") == 1 and text.count(b"\nB\n") == 1


def test_an_unknown_instruction_set_is_named(monkeypatch):
    monkeypatch.setenv("HYBRIDRL_KERNEL_ISA", "avx9000")
    with pytest.raises(RuntimeError, match="HYBRIDRL_KERNEL_ISA='avx9000'.*native, avx2, portable"):
        native_build.isa_flags()


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def _in_subprocess(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=1800)


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_instruction_set_a_build_may_use(tmp_path, isa):
    """``avx2`` leaves AVX-512 out (the AVX2 code, where the CPU has it); ``portable`` has no vector
    code, so the kernels report themselves unsupported and torch's ops run."""
    env = {"HYBRIDRL_KERNEL_ISA": isa, "HYBRIDRL_KERNEL_CACHE": str(tmp_path / "kc")}
    out = _in_subprocess(env, "-c", "from hybridrl.engine import cpu_attention as c; print(c.simd_width(), c.available())")
    assert out.returncode == 0, out.stderr[-3000:]
    want = ("256 True" if {"avx2", "fma"} <= _cpu_flags() else "0 False") if isa == "avx2" else "0 False"
    assert out.stdout.split("\n")[-2] == want


@pytest.mark.skipif(not {"avx512f", "avx2", "fma"} <= _cpu_flags(),
                    reason="an AVX-512 CPU: elsewhere the default build is the AVX2 code (or neither)")
def test_the_avx2_kernels_pass_the_kernel_tests_on_an_avx512_machine(tmp_path):
    """Both vector paths of hr_simd.h tested on one machine: the kernel tests again, built for AVX2."""
    env = {"HYBRIDRL_KERNEL_ISA": "avx2", "HYBRIDRL_KERNEL_CACHE": str(tmp_path / "kc")}
    out = _in_subprocess(env, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/test_cpu_attention.py",
                         "tests/engine/test_cpu_layers.py", "tests/engine/test_token_stats.py",
                         "tests/rollout/test_cpu_kernels.py")
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary

"""Build and load hybridrl's C kernels on first use, the way inductor compiles its CPU kernels.

A source file is compiled once per machine with the C compiler on the PATH (``$CC``, else ``cc``)
into ``$HYBRIDRL_KERNEL_CACHE`` (default ``~/.cache/hybridrl/kernels``), under a name that hashes
the source (with the local headers it includes), the flags, the compiler and the CPU, and loaded with ctypes. The machine's own
instruction set is tried first (``-march=native``), then portable code. Used by the rollout's decode
kernels (``hybridrl.rollout.cpu_kernels``) and the trainer's attention (``hybridrl.engine.cpu_attention``).

The kernels have code for AVX-512 and for AVX2 + FMA (``hybridrl/utils/hr_simd.h``) and report
themselves unsupported with neither. ``HYBRIDRL_KERNEL_ISA`` picks what a build may use: ``native``
(the default: all the machine has), ``avx2`` (the machine's, AVX-512 left out: the AVX2 code on an
AVX-512 machine, which is how the tests cover both there) or ``portable`` (no SIMD code: torch's ops).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["FLAGS", "ISA_FLAGS", "build_library", "cache_dir", "isa_flags", "source_bytes"]

# -ffast-math lets the compiler vectorise the sums and call the vector expf; contraction into fused
# multiply-adds and reciprocal tricks are turned back off so products and divisions round as torch's do.
FLAGS = ["-O3", "-ffast-math", "-ffp-contract=off", "-fno-reciprocal-math", "-fopenmp", "-shared", "-fPIC"]
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"], "portable": []}
LIBS = ["-lm"]
VECTOR_MATH = ["-lmvec"]  # glibc's vector math (expf for 16 lanes); absent on other C libraries


def isa_flags() -> list[str]:
    """The instruction-set flags ``HYBRIDRL_KERNEL_ISA`` asks for (default ``native``)."""
    isa = os.environ.get("HYBRIDRL_KERNEL_ISA", "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise RuntimeError(f"HYBRIDRL_KERNEL_ISA={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    return ISA_FLAGS[isa]


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDRL_KERNEL_CACHE") or Path.home() / ".cache" / "hybridrl" / "kernels")


def cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first core's ``key: value`` lines of /proc/cpuinfo (read when ``cpuinfo`` is None; none
    where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _cpu_id() -> str:
    """The CPU model and instruction-set flags: a library built with -march=native on one machine may
    not run on another sharing the same home directory (an NFS home on a cluster)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(wanted))  # the first core's lines (all cores repeat them)


def _compiler_id(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else cc


def _build(cc: str, source: Path, flags: list[str], libs: list[str], target: Path) -> None:
    """Compile into a temporary sibling and rename into place (parallel builders never see half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([cc, *flags, str(source), *libs, "-o", tmp], capture_output=True, text=True, timeout=300)
        if result.returncode:
            raise RuntimeError(f"{cc} {' '.join(flags)} {source} {' '.join(libs)} failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def source_bytes(source: Path, _seen: set[Path] | None = None) -> bytes:
    """The source and, after it, every local header it includes (``#include "..."``, resolved from
    the including file's folder, recursively, each once): what a build depends on, so a change to a
    shared header rebuilds every source that includes it."""
    seen = set() if _seen is None else _seen
    source = Path(source).resolve()
    seen.add(source)
    code = source.read_bytes()
    parts = [code]
    for name in _LOCAL_INCLUDE.findall(code):
        header = (source.parent / name.decode()).resolve()
        if header not in seen and header.is_file():
            parts.append(source_bytes(header, seen))
    return b"\0".join(parts)


def build_library(source: Path, what: str) -> ctypes.CDLL:
    """Compile (or reuse) ``source`` and load it; raises RuntimeError with the compiler's messages,
    naming ``what`` (e.g. "the CPU decode kernels"), when no variant builds and loads."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError(f"no C compiler found (looked for {os.environ.get('CC', 'cc')!r} on PATH)")
    code = source_bytes(source)
    compiler, cpu = _compiler_id(cc), _cpu_id()
    errors = []
    # the machine's own instruction set first; then portable code; glibc's vector expf where present
    native = isa_flags()
    for flags, libs in ((FLAGS + native, VECTOR_MATH + LIBS), (FLAGS + native, LIBS), (FLAGS, LIBS)):
        key = hashlib.sha256(b"\0".join([code, " ".join(flags + libs).encode(), compiler.encode(),
                                         platform.machine().encode(), cpu.encode()])).hexdigest()[:20]
        target = cache_dir() / f"{Path(source).stem}_{key}.so"
        try:
            if not target.is_file():
                _build(cc, Path(source), flags, libs, target)
            return ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
    raise RuntimeError(f"could not build {what}:\n" + "\n".join(errors))

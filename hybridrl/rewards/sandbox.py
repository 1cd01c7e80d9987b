"""Run untrusted (model-written) Python code in a contained child process.

No containers are needed; the layers, from the outside in:

1. **Namespaces** (when the ``unshare`` tool works, e.g. as root): a new network namespace (no
   interface is up, so nothing can be reached) and a new PID namespace whose init is the sandboxed
   interpreter: when it dies, the kernel kills every process it started, even ones that left the
   process group.
2. **An unprivileged user**: as root, the child drops to ``nobody`` before running the code; the
   sandbox directory is the only place it owns, so file permissions deny writes elsewhere.
3. **Resource limits** set before the code runs: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS``
   (address space), ``RLIMIT_NPROC`` (fork bombs; counted per user, so it bites once the child
   is ``nobody``), ``RLIMIT_FSIZE`` (bytes per written file, stdout/stderr included: they go to
   files, so flooding them ends the child with SIGXFSZ), ``RLIMIT_NOFILE``, no core files.
4. **An audit hook** (``sys.addaudithook``, defence in depth): socket connect/bind/send, opening
   for write, creating, renaming or deleting paths outside the sandbox directory, starting
   programs (``os.system``, ``exec``, ``subprocess``) and ``ctypes`` are refused with
   ``PermissionError`` inside the interpreter.
5. **A wall-clock limit** in the parent: past ``wall_s`` the whole process group is killed.

The sandbox directory (the child's cwd, HOME and TMPDIR) is deleted afterwards. Nothing here
imports torch: reward worker processes call it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxLimits", "SandboxResult", "namespaces_available", "run_sandboxed"]

NOBODY_UID = NOBODY_GID = 65534
# Imported by the runner before it drops to ``nobody``: the interpreter's stdlib may sit in a
# directory only root can read (e.g. under /root), and model-written code expects these to import.
_PRELOAD = (
    "array bisect collections copy dataclasses datetime decimal encodings.idna enum fractions functools heapq itertools "
    "json math operator random re socket statistics string textwrap time typing unittest shutil subprocess "
    "pathlib glob tempfile io struct hashlib base64 numbers queue threading"
)
_UNSHARE = ("unshare", "--net", "--pid", "--fork", "--kill-child", "--")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (see the module docstring for how each is enforced)."""

    wall_s: float = 10.0  # wall-clock seconds before the process group is killed
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    output_bytes: int = 1 << 16  # stdout / stderr / any written file (RLIMIT_FSIZE)
    max_processes: int = 16  # processes of the sandbox user (RLIMIT_NPROC)
    max_open_files: int = 64  # RLIMIT_NOFILE


@dataclass(frozen=True)
class SandboxResult:
    """What a run did. ``completed``: the code ran to its end (the runner then printed a per-run
    nonce that the parent strips from ``stdout``); ``ok``: completed and exited 0 within the limits."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    completed: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.completed and not self.timed_out

    def reason(self) -> str:
        """One line on how it ended, for logs and reward metadata."""
        if self.timed_out:
            return f"killed after the wall-clock limit ({self.duration_s:.1f} s)"
        if self.returncode is not None and self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        last = self.stderr.strip().splitlines()[-1:] or [""]
        if last[0].startswith("unshare: "):  # unshare(1) reports a child killed by a signal it cannot re-raise
            return "killed by a signal (a CPU-time, memory or file-size limit)"
        if self.returncode == 0 and not self.completed:
            return "exited before the end of the code"
        return f"exit code {self.returncode}" + (f": {last[0][:200]}" if last[0] else "")


_nsfree: bool | None = None


def namespaces_available() -> bool:
    """Whether ``unshare --net --pid`` works here (needs root or unprivileged user namespaces)."""
    global _nsfree
    if _nsfree is None:
        if shutil.which("unshare") is None:
            _nsfree = False
        else:
            probe = subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=30)
            _nsfree = probe.returncode == 0
    return _nsfree


def run_sandboxed(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "",
                  exit_counts_as_completed: bool = True) -> SandboxResult:
    """Run the Python source ``code`` in a sandbox with ``stdin``; never raises for what the code does.

    ``exit_counts_as_completed=False`` treats ``sys.exit()`` anywhere in ``code`` as not completing
    (for code followed by its unit tests: an early exit must not skip them). ``os._exit`` never
    completes: completion is proven by a nonce only the runner prints after the code returns.
    """
    box = Path(tempfile.mkdtemp(prefix="hybridrl-sandbox-"))
    logs = Path(tempfile.mkdtemp(prefix="hybridrl-sandbox-logs-"))
    try:
        (box / "main.py").write_text(code)
        drop = os.geteuid() == 0
        if drop:
            os.chown(box, NOBODY_UID, NOBODY_GID)
            os.chown(box / "main.py", NOBODY_UID, NOBODY_GID)
        spec = _limit_spec(limits, drop, exit_counts_as_completed)
        command = [sys.executable, "-I", "-c", _RUNNER, str(box), spec]
        if namespaces_available():
            command = [*_UNSHARE, *command]
        return _execute(command, box, logs, limits, stdin)
    finally:
        shutil.rmtree(box, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)


def _limit_spec(limits: SandboxLimits, drop: bool, exit_ok: bool) -> str:
    nproc = limits.max_processes if drop else _own_process_count() + limits.max_processes
    values = (limits.cpu_s, limits.memory_mb << 20, limits.output_bytes, nproc, limits.max_open_files,
              int(drop), int(exit_ok))
    return ",".join(str(v) for v in values)


def _own_process_count() -> int:
    """Processes of this user: without a uid change RLIMIT_NPROC counts them all."""
    uid = os.getuid()
    return sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == uid)


def _owner(path: Path) -> int | None:
    try:
        return path.stat().st_uid
    except OSError:  # the process ended while we looked
        return None


def _execute(command: list[str], box: Path, logs: Path, limits: SandboxLimits, stdin: str) -> SandboxResult:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(box), "TMPDIR": str(box), "LANG": "C.UTF-8"}
    nonce = secrets.token_hex(16)
    start = time.monotonic()
    with open(logs / "out", "wb") as out, open(logs / "err", "wb") as err:
        proc = subprocess.Popen(command, cwd=box, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                start_new_session=True)
        timed_out = False
        try:
            proc.communicate(f"{nonce}\n{stdin}".encode(), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)
    duration = time.monotonic() - start
    stdout = (logs / "out").read_bytes()[: limits.output_bytes + 64].decode(errors="replace")
    stderr = (logs / "err").read_bytes()[: limits.output_bytes].decode(errors="replace")
    marker = f"\n{nonce}\n"
    completed = stdout.endswith(marker)
    if completed:
        stdout = stdout[: -len(marker)]
    return SandboxResult(proc.returncode, stdout, stderr, timed_out, completed, duration)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it leads a session of its own) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already gone: nothing left to kill
    proc.wait()


# Runs in the child's fresh interpreter (``python -I -c``): nonce, limits, user, audit hook, code.
_RUNNER = r'''
import os, resource, sys

PRELOAD = """PRELOAD_NAMES"""

def _main():
    box, spec = sys.argv[1], sys.argv[2]
    cpu, mem, fsize, nproc, nofile, drop, exit_ok = (int(v) for v in spec.split(","))
    nonce = b""
    while not nonce.endswith(b"\n"):  # unbuffered: the code's stdin starts right after this line
        byte = os.read(0, 1)
        if not byte:
            break
        nonce += byte
    for name in PRELOAD.split():  # imported while the stdlib is readable; harmless where it still is
        try:
            __import__(name)
        except ImportError:
            pass
    for lim, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                       (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NOFILE, (nofile, nofile)),
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(lim, value)
    if drop:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    os.chdir(box)
    with open(os.path.join(box, "main.py")) as fh:
        source = fh.read()
    sys.addaudithook(_hook_for(os.path.realpath(box)))
    sys.argv = ["main.py"]
    sys.path.insert(0, box)
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        if not exit_ok or exc.code not in (None, 0):
            raise
    sys.stdout.flush()
    sys.stdout.write("\n" + nonce.decode().strip() + "\n")
    sys.stdout.flush()

def _hook_for(root):
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    blocked = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "os.system", "os.exec",
               "os.posix_spawn", "os.spawn", "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym",
               "ctypes.cdata", "sys.addaudithook")
    path_events = ("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown", "os.link",
                   "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move")

    def inside(path):
        if isinstance(path, int):
            return True
        real = os.path.realpath(os.fsdecode(path))
        return real == root or real.startswith(root + os.sep)

    def hook(event, args):
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & write_flags
            if path is not None and writes and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox is not allowed")
        elif event in path_events:
            for a in args:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} on {a!r} outside the sandbox is not allowed")

    return hook

_main()
'''.replace("PRELOAD_NAMES", _PRELOAD)

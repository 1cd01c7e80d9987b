"""A small process pool for reward functions that can kill a hung task.

``concurrent.futures.ProcessPoolExecutor`` cannot stop a task that never returns: its worker stays
busy forever and shutting the pool down waits on it. Here each worker process runs one task at a
time over its own pipe; the parent tracks a deadline per task and, when it passes, kills that
process and starts a fresh one. A worker that dies (segfault, ``os._exit``, OOM kill) is reported
the same way. Workers are started with ``spawn`` (default) or ``forkserver``: safe inside Ray actors
and threads, and nothing from the parent (CUDA, locks) is inherited. This module imports no torch,
so a worker starts in a Python start-up plus ``hybridrl.rewards``.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

_STARTUP_TIMEOUT_S = 120.0


@dataclass
class TaskOutcome:
    """What one call returned (``value``), or why it did not (``error`` + ``traceback``, ``timed_out``)."""

    value: Any = None
    error: str | None = None
    traceback: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def run_task(fn: Callable[..., Any], kwargs: dict[str, Any]) -> TaskOutcome:
    """Call ``fn(**kwargs)`` here, turning an exception into a failed outcome (no timeout)."""
    try:
        return TaskOutcome(value=fn(**kwargs))
    except Exception as exc:  # a user reward function may raise anything: report it, never hide it
        return TaskOutcome(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())


def _worker_main(conn: Connection) -> None:
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        task_id, fn, kwargs = message
        outcome = run_task(fn, kwargs)
        try:
            conn.send((task_id, outcome))
        except Exception as exc:  # e.g. the returned value cannot be pickled
            conn.send((task_id, TaskOutcome(error=f"result could not be sent back: {type(exc).__name__}: {exc}")))


class _Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="hybridrl-reward")
        self.process.start()
        child.close()
        self.task_id: int | None = None
        self.deadline = float("inf")

    def wait_ready(self) -> None:
        if not self.conn.poll(_STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"reward worker process did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        if self.conn.recv() != "ready":
            raise RuntimeError("reward worker process sent an unexpected start-up message")

    def submit(self, task_id: int, fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float) -> None:
        self.task_id, self.deadline = task_id, time.monotonic() + timeout_s
        self.conn.send((task_id, fn, kwargs))

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class ScoringPool:
    """``num_workers`` processes scoring tasks with a per-task timeout; reused across :meth:`map` calls."""

    def __init__(self, num_workers: int, timeout_s: float, mp_context: str = "spawn") -> None:
        if num_workers < 1:
            raise ValueError(f"ScoringPool needs num_workers >= 1, got {num_workers}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be 'spawn' or 'forkserver', got {mp_context!r}")
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self._ctx = mp.get_context(mp_context)
        self._workers: list[_Worker] = []  # mutated in place: the finalizer below holds this list
        self.restarts = 0  # workers replaced after a timeout or a crash, over the pool's life
        # A pool dropped without close() still stops its processes when garbage-collected.
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    def _start(self, count: int) -> list[_Worker]:
        workers = [_Worker(self._ctx) for _ in range(count)]  # start all, then wait: they boot in parallel
        for w in workers:
            w.wait_ready()
        return workers

    def map(self, fn: Callable[..., Any], kwargs_list: list[dict[str, Any]]) -> list[TaskOutcome]:
        """``[fn(**kw) for kw in kwargs_list]`` in the workers; always returns one outcome per task."""
        missing = self.num_workers - len(self._workers)
        if missing > 0:
            self._workers += self._start(missing)
        outcomes: list[TaskOutcome | None] = [None] * len(kwargs_list)
        pending, busy = deque(range(len(kwargs_list))), {}
        idle = list(self._workers)
        while pending or busy:
            while pending and idle:
                w, i = idle.pop(), pending.popleft()
                w.submit(i, fn, kwargs_list[i], self.timeout_s)
                busy[w.conn] = w
            next_deadline = min(w.deadline for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                idle.append(self._receive(busy.pop(conn), outcomes))
            for conn, w in list(busy.items()):
                if w.deadline <= time.monotonic():
                    del busy[conn]
                    outcomes[w.task_id] = TaskOutcome(
                        error=f"timed out after {self.timeout_s:g} s; worker process killed", timed_out=True
                    )
                    idle.append(self._replace(w))
        return outcomes  # type: ignore[return-value]

    def _receive(self, w: _Worker, outcomes: list[TaskOutcome | None]) -> _Worker:
        try:
            task_id, outcome = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(timeout=5)
            outcomes[w.task_id] = TaskOutcome(
                error=f"reward worker process died (exit code {w.process.exitcode}) while scoring"
            )
            return self._replace(w)
        outcomes[task_id] = outcome
        return w

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self.restarts += 1
        (fresh,) = self._start(1)
        self._workers[self._workers.index(w)] = fresh
        return fresh

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        _stop_workers(self._workers)


def _stop_workers(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except OSError:
            pass  # already dead: the join/kill below cleans up
    for w in workers:
        w.process.join(timeout=2)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=5)
        w.conn.close()
    workers.clear()

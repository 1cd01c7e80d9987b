"""Errors a worker group raises on the driver when a rank fails."""

from __future__ import annotations

__all__ = ["WorkerDiedError", "WorkerError"]


class WorkerError(RuntimeError):
    """A rank raised inside a worker method; carries who, where, and the remote traceback.

    Attributes: ``role``, ``worker_class`` (class name), ``rank``, ``world_size``, ``method``
    (``"__init__"`` while the roles are being built), ``pid``, ``node`` and ``remote_traceback``
    (the worker's formatted traceback). ``str(err)`` is a headline naming all of them followed by
    the traceback, so an uncaught WorkerError ends the driver with the worker's traceback printed.
    """

    what = "raised"

    def __init__(
        self,
        role: str,
        worker_class: str,
        rank: int,
        world_size: int,
        method: str,
        pid: int | None,
        node: str | None,
        remote_traceback: str,
    ) -> None:
        self.role, self.worker_class, self.rank, self.world_size = role, worker_class, rank, world_size
        self.method, self.pid, self.node, self.remote_traceback = method, pid, node, remote_traceback
        super().__init__(f"{self.headline()}\n{remote_traceback}")

    def headline(self) -> str:
        return (
            f"worker {self.worker_class} (role {self.role!r}) rank {self.rank} of {self.world_size} "
            f"{self.what} in {self.method}() [pid {self.pid} on {self.node}]"
        )

    def __reduce__(self):
        args = (self.role, self.worker_class, self.rank, self.world_size, self.method, self.pid, self.node,
                self.remote_traceback)
        return (type(self), args)


class WorkerDiedError(WorkerError):
    """A rank's process died (os._exit, SIGKILL, out of memory, node lost) during a method."""

    what = "died (process exited or was killed)"

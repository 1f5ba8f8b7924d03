"""Stall watchdog: a rank blocked too long in MPI reports what it waits for, then ends the job.

A daemon thread checks the operation the main thread is blocked in (set by `guard`); past the
timeout it prints the operation, peer, step and micro-batch, and calls `MPI_Abort`. Guarding
costs two attribute writes per operation; mpi4py releases the GIL in blocking calls, so the
thread runs while the main thread waits.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

ENV_TIMEOUT = "HYPARFLOW_WATCHDOG_TIMEOUT"
DEFAULT_TIMEOUT = 300.0


def resolve_timeout(timeout: float | None) -> float:
    """The argument if given, else $HYPARFLOW_WATCHDOG_TIMEOUT, else 300 s (0 disables)."""
    if timeout is None:
        timeout = float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT))
    if timeout < 0:
        raise ValueError(f"watchdog_timeout must be >= 0 seconds (0 disables it), got {timeout}")
    return float(timeout)


class Watchdog:
    """Guards blocking MPI operations of this rank with a timeout.

    For example:
        dog = Watchdog(comm, timeout=60)
        with dog.guard("recv activations", peer=0, microbatch=3):
            channel.recv(3, "forward")
    """

    def __init__(self, comm, timeout: float, abort=None, poll: float | None = None):
        self.comm = comm
        self.timeout = timeout
        self.step = None  # set by the trainer for the report
        self._operation = None
        self._since = 0.0
        self._abort = abort or (lambda: comm.Abort(1))
        self._stop = threading.Event()
        self._thread = None
        if timeout > 0:
            self._poll = poll or min(1.0, max(0.05, timeout / 20))
            self._thread = threading.Thread(target=self._watch, name="hyparflow-watchdog")
            self._thread.daemon = True
            self._thread.start()

    @contextlib.contextmanager
    def guard(self, operation: str, peer=None, microbatch=None):
        """Mark the main thread as blocked in `operation` until the block ends."""
        self._operation = (operation, peer, microbatch)
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._operation = None

    def report(self) -> str | None:
        """What the rank is stalled in, if it has waited longer than the timeout."""
        operation = self._operation
        if operation is None or self.timeout <= 0:
            return None
        waited = time.monotonic() - self._since
        if waited < self.timeout:
            return None
        name, peer, microbatch = operation
        where = [f"step {self.step}" if self.step is not None else None]
        where.append(f"micro-batch {microbatch}" if microbatch is not None else None)
        where.append(f"peer rank {peer}" if peer is not None else None)
        detail = ", ".join(w for w in where if w)
        return (
            f"hyparflow rank {self.comm.Get_rank()}: stalled {waited:.0f} s in {name}"
            f"{' (' + detail + ')' if detail else ''}; another rank is probably hung or dead. "
            f"Aborting the job (timeout {self.timeout:g} s: watchdog_timeout= or ${ENV_TIMEOUT})."
        )

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            message = self.report()
            if message:
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
                self._abort()
                return

    def close(self) -> None:
        self._stop.set()


class NoWatchdog:
    """Stand-in when the watchdog is off: guards do nothing."""

    step = None
    _NULL = contextlib.nullcontext()

    def guard(self, operation: str, peer=None, microbatch=None):
        return self._NULL

    def close(self) -> None:
        pass


class Guard:
    """The guard every part of a trainer watches its blocking waits with: `guard(operation,
    peer, microbatch)` uses the watchdog in force, which `use(timeout)` replaces (each fit
    names its own timeout; 0: none). `at_step(step)` names the step in a stall report."""

    def __init__(self, comm, timeout: float = 0.0):
        self.comm = comm
        self.watchdog = NoWatchdog()
        self.use(timeout)

    def use(self, timeout: float) -> None:
        if getattr(self.watchdog, "timeout", 0) == timeout:
            return
        self.watchdog.close()
        self.watchdog = Watchdog(self.comm, timeout) if timeout > 0 else NoWatchdog()

    def __call__(self, operation: str, peer=None, microbatch=None):
        return self.watchdog.guard(operation, peer, microbatch)

    def at_step(self, step: int) -> None:
        self.watchdog.step = step

    def close(self) -> None:
        self.watchdog.close()

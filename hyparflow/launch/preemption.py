"""Preemption between the launcher and the ranks: the signals that ask a job to checkpoint and
stop, and the exit status that says it did (docs/reliability.md, "Preemption").

A batch system preempts a job with SIGTERM (Slurm's `--signal`, `scancel`). Open MPI's mpirun
turns a SIGTERM of its own into SIGKILL for the ranks one second later, too soon to finish a
step and save it; it forwards SIGUSR1 unchanged. So `hyparflow run` passes a SIGTERM on to its
launcher as SIGUSR1, and the ranks of an `hf.fit` with an `hf.callbacks.Checkpoint` take either
signal as the request: every rank finishes its step, they agree on the step, save it, and
exit with `PREEMPTED_STATUS`. Imports neither MPI nor TensorFlow (the launcher uses it).
"""

from __future__ import annotations

import signal
import threading

# sysexits.h's EX_TEMPFAIL, "a temporary failure; try again later": what a requeueing batch
# script tests for (examples/slurm/requeue.sbatch)
PREEMPTED_STATUS = 75
# what a rank takes as "checkpoint and stop": a batch system's SIGTERM, or hyparflow run's
# SIGUSR1 (the one mpirun forwards)
RANK_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
FORWARDED_AS = signal.SIGUSR1  # how hyparflow run passes a SIGTERM on to mpirun or srun


class Preempted(SystemExit):
    """Raised by `hf.fit` on every rank once a preemption signal's checkpoint is saved: left
    uncaught (it is not an `Exception`), the process exits with `PREEMPTED_STATUS`.

    For example, a script that wants to log before it goes:
        try:
            hf.fit(model, x, y, callbacks=[hf.callbacks.Checkpoint("ckpt/")], resume=True)
        except hf.Preempted as stop:
            print(stop.message)
            raise
    """

    def __init__(self, message: str):
        super().__init__(PREEMPTED_STATUS)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SignalFlag:
    """Records which of `signals` arrived while entered, instead of their usual action; the
    handlers that were there before are put back on exit. Outside the main thread (where
    Python cannot install handlers) it records nothing.

    Example:
        >>> import os
        >>> with SignalFlag([signal.SIGUSR1]) as flag:
        ...     os.kill(os.getpid(), signal.SIGUSR1)
        >>> flag.received == signal.SIGUSR1
        True
    """

    def __init__(self, signals):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalFlag:
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _record(self, number, _frame) -> None:
        if self.received is None:
            self.received = number


def signal_name(number: int) -> str:
    """`SIGTERM` for 15.

    Example:
        >>> signal_name(signal.SIGTERM)
        'SIGTERM'
    """
    return signal.Signals(number).name

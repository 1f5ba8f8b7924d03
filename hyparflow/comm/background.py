"""Collectives run ahead, on a thread of their own, while the main thread computes.

Open MPI progresses a nonblocking collective only inside MPI calls, and a rank computing in
TensorFlow makes none; a thread blocked in the collective progresses it meanwhile (as the
gradient reducer's `background` thread does, comm/allreduce.py). `BackgroundCollectives`
runs the calls it is given one at a time, in the order given, so that every rank's thread
enters the same collectives in the same order. Its communicator must be one the main
thread does not use (a duplicate), and unwatched: the failure channel is the main thread's,
which watches the wait for a result instead (`failure.wait_until`).

The thread is a daemon: where a peer failed and a collective never ends, the process can
still leave (the job ends with the failed rank, comm/failure.py).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from hyparflow.comm import failure


class BackgroundCollectives:
    """A daemon thread running submitted calls in order; each `submit` returns a `Future`.

    Example:
        ahead = BackgroundCollectives("hyparflow-gather")
        done = ahead.submit(lambda: comm.Allgather(mine, whole))
        ...                              # compute meanwhile
        ahead.wait(done)                 # leaves with PeerFailed if a peer failed
        ahead.stop()
    """

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call) -> Future:
        future: Future = Future()
        self._queue.put((call, future))
        return future

    @staticmethod
    def wait(future: Future):
        """`future`'s result, waited for under the running loop's failure channel."""
        failure.wait_until(future.done)
        return future.result()

    def stop(self) -> None:
        """End the thread once what was submitted has run."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            _run_one(*item)
            item = None  # the call's buffers and result go with their waiter, not stay here


def _run_one(call, future: Future) -> None:
    try:
        future.set_result(call())
    except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
        future.set_exception(error)

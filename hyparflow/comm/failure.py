"""Failure channel: a rank that fails mid-step tells the others, and their MPI waits raise.

Open MPI 4 has no way to interrupt a peer blocked in MPI (ULFM's revoke is Open MPI 5, opt-in).
So while a collective loop runs (`run_collectively`), hyparflow's blocking waits poll instead:
point-to-point waits test their requests and probe a notice channel in turn (`wait_all`), and
blocking collectives first meet in a nonblocking barrier that is polled the same way (`arrive`,
done by the grid's communicators, `watched`). A rank that fails prints one line and sends a
notice to every other rank; each leaves the wait it is in with `PeerFailed`, and all of them then
agree that the step failed (`agree.all_failed`) and raise: the failing rank its own error, the
others `RemoteRankError` naming it. A rank blocked somewhere not polled (inside TensorFlow, or a
user's own MPI call) never answers: after `FAILURE_AGREEMENT_SECONDS` the job is aborted as before.
"""

from __future__ import annotations

import contextlib
import sys

from hyparflow.comm.agree import (
    AgreedError,
    RemoteRankError,
    abort_on_error,
    all_failed,
    failure_comm,
    is_agreed,
)
from hyparflow.comm.idle import Idle, shares_cores

NOTICE_TAG = 7_919  # the only tag on the channel's own communicator

# The channel of the collective loop running now (one loop at a time per process).
_active: FailureChannel | None = None
_channels: dict[int, FailureChannel] = {}


class PeerFailed(RuntimeError):
    """Raised in a wait of a rank whose peer announced that it failed."""


class FailureChannel:
    """Failure notices between the ranks of `comm`, on a duplicate of it (collective).

    For example:
        channel = FailureChannel(comm)
        channel.wait([comm.Irecv(buffer, source=0)])   # raises PeerFailed if rank 1 fails
    """

    def __init__(self, comm):
        self.comm = comm.Dup()
        self.sharing = shares_cores(comm)  # collective, as the Dup is
        self.notice: tuple[int, str] | None = None  # (rank, error) of the first notice read
        self.announced = False
        self._sends: list = []  # kept so that the notices' buffers live until delivered

    def check(self) -> None:
        """Raise `PeerFailed` if another rank has announced a failure; never blocks."""
        if self.notice is None:
            message = self.comm.improbe(source=_mpi().ANY_SOURCE, tag=NOTICE_TAG)
            if message is None:
                return
            self.notice = message.recv()
        rank, error = self.notice
        raise PeerFailed(f"rank {rank} failed: {error}")

    def wait(self, requests, statuses=None) -> None:
        """`MPI.Request.Waitall(requests, statuses)` that leaves when another rank fails."""
        mpi = _mpi()
        self.until(lambda: mpi.Request.Testall(requests, statuses))

    def until(self, done) -> None:
        """Poll `done()` until it is true, leaving with `PeerFailed` when another rank fails."""
        idle = Idle(self.sharing)
        while not done():
            self.check()
            idle()

    def arrive(self, comm) -> None:
        """Wait until every rank of `comm` has reached this point, or another rank fails."""
        self.wait([_mpi().Intracomm.Ibarrier(comm)])

    def announce(self, error: BaseException) -> None:
        """Say on stderr that this rank failed, and tell every other rank (never blocks)."""
        rank = self.comm.Get_rank()
        text = _first_line(error)
        sys.stderr.write(f"hyparflow rank {rank} failed: {text}; stopping the others\n")
        sys.stderr.flush()
        for peer in range(self.comm.Get_size()):
            if peer != rank:
                self._sends.append(self.comm.isend((rank, text), dest=peer, tag=NOTICE_TAG))
        self.announced = True


def wait_all(requests, statuses=None) -> None:
    """`MPI.Request.Waitall`, watched by the running loop's failure channel if there is one."""
    if _active is None:
        _mpi().Request.Waitall(requests, statuses)
    else:
        _active.wait(requests, statuses)


def wait_until(done) -> None:
    """Poll `done()` until it is true (a result another thread makes), leaving with
    `PeerFailed` if the running loop's failure channel hears of a failure meanwhile."""
    if _active is not None:
        _active.until(done)
        return
    idle = Idle(False)
    while not done():
        idle()


def arrive(comm) -> None:
    """Before a blocking collective on `comm`: meet the other ranks, or raise `PeerFailed`."""
    if _active is not None:
        _active.arrive(comm)


@contextlib.contextmanager
def watching(channel: FailureChannel):
    """Let `wait_all` and `arrive` poll `channel` inside the block."""
    global _active
    previous, _active = _active, channel
    try:
        yield channel
    finally:
        _active = previous


def run_collectively(comm, work, on_failure=None):
    """Run `work()` on every rank of `comm` and return its result; if it fails on any rank, raise
    on every rank (or, if some rank cannot be reached, end the job).

    An error raised identically everywhere (agreed) propagates at once. Any other error is
    announced to the others, whose waits leave; once every rank has failed, `on_failure()` runs
    (drop what holds half-sent messages) and each rank raises: its own error, or
    `RemoteRankError` naming the rank that failed first.
    """
    failures = failure_comm(comm)  # collective: before any rank can fail
    channel = _channel(comm)
    try:
        with watching(channel):
            result = work()
            channel.arrive(comm)  # nobody failed after its last collective
        return result
    except Exception as error:  # noqa: BLE001 - every failure must reach every rank
        if is_agreed(error) and channel.notice is None:
            raise
        if channel.notice is None and not channel.announced:
            channel.announce(error)
        if all_failed(failures, error):
            _channels.pop(comm.py2f(), None)  # notices may still be in flight on it
            if on_failure is not None:
                on_failure()
            raise _as_raised(channel, error) from None
        abort_on_error(comm, error, "training step")


def _as_raised(channel: FailureChannel, error: Exception) -> Exception:
    """What this rank raises once every rank failed: its own error, or the peer's."""
    if channel.announced or channel.notice is None:
        return AgreedError(error)
    rank, text = channel.notice
    return AgreedError(RemoteRankError(f"rank {rank} failed: {text}"))


def watched(comm):
    """`comm` (same handle) whose blocking collectives first `arrive`, so a peer's failure
    reaches a rank waiting in them."""
    return _watched_class()(comm)


def unwatched(comm):
    """`comm` (same handle) whose collectives do not meet first: for a thread other than the
    one the failure channel watches (comm/background.py)."""
    return _mpi().Intracomm(comm)


def _watched_class():
    global _WATCHED
    if _WATCHED is None:
        _WATCHED = _make_watched_class()
    return _WATCHED


_WATCHED = None
# mpi4py's blocking collectives that hyparflow calls on the grid's communicators.
_COLLECTIVES = (
    "Allreduce",
    "allreduce",
    "Bcast",
    "bcast",
    "Allgather",
    "allgather",
    "Allgatherv",
    "Reduce_scatter_block",
    "Reduce",
    "reduce",
    "Gather",
    "gather",
    "Barrier",
    "barrier",
    "Alltoall",
    "Alltoallv",
    "alltoall",
)


def _make_watched_class():
    mpi = _mpi()

    def arriving(name):
        plain = getattr(mpi.Intracomm, name)

        def collective(self, *args, **kwargs):
            arrive(self)
            return plain(self, *args, **kwargs)

        collective.__name__ = name
        return collective

    methods = {name: arriving(name) for name in _COLLECTIVES}
    return type("WatchedComm", (mpi.Intracomm,), methods)


def _channel(comm) -> FailureChannel:
    key = comm.py2f()
    if key not in _channels:
        _channels[key] = FailureChannel(comm)
    return _channels[key]


def _first_line(error: BaseException) -> str:
    """The error in one line. TensorFlow's op errors open with "Graph execution error:" and a
    traceback: their message is the last unindented line."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if lines and lines[0].endswith(":"):
        lines = [line for line in lines if not line[0].isspace()][-1:]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _mpi():
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    return MPI

"""BackgroundCollectives on one process: calls run in order on a thread of their own, and
their results and errors reach the waiting thread."""

import threading

import pytest

from hyparflow.comm.background import BackgroundCollectives


def test_calls_run_in_the_order_given_on_one_thread_other_than_the_callers():
    ahead = BackgroundCollectives("test-ahead")
    seen = []
    release = threading.Event()

    def call(n):
        if n == 0:
            release.wait()  # the later calls queue behind the first
        seen.append((n, threading.current_thread().name))
        return n * n

    futures = [ahead.submit(lambda n=n: call(n)) for n in range(4)]
    assert not any(f.done() for f in futures)
    release.set()
    assert [ahead.wait(f) for f in futures] == [0, 1, 4, 9]
    assert seen == [(n, "test-ahead") for n in range(4)]
    ahead.stop()


def test_an_error_on_the_thread_is_raised_where_the_result_is_waited_for():
    ahead = BackgroundCollectives("test-ahead")
    failed = ahead.submit(lambda: 1 / 0)
    after = ahead.submit(lambda: "still runs")
    with pytest.raises(ZeroDivisionError):
        ahead.wait(failed)
    assert ahead.wait(after) == "still runs"
    ahead.stop()

"""BackgroundCollectives on one process: calls run in order on a thread of their own, and
their results and errors reach the waiting thread."""

import gc
import threading
import time
import weakref

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


class _Result:
    """A call's result that can be watched with a weak reference."""


def test_the_thread_keeps_nothing_of_a_call_once_its_result_is_handed_over():
    """A gathered vector must not outlive its waiter in the thread (it is a segment's weights):
    once the result is taken, the thread holds no reference to it while it waits for more."""
    ahead = BackgroundCollectives("test-ahead")
    made = []

    def call():
        result = _Result()
        made.append(weakref.ref(result))
        return result

    future = ahead.submit(call)
    ahead.wait(future)
    future = None
    deadline = time.monotonic() + 5.0  # the thread lets go right after handing it over
    while made[0]() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert made[0]() is None
    ahead.stop()

"""Ranks short of cores are pinned one core each, stages mixed on every core; others left alone."""

import os
import sys

import pytest

from hyparflow.comm.topology import Grid
from hyparflow.launch.affinity import core_for_rank, deal_to_cores
from tests.support.mpirun import run_scenario
from tests.support.probe import python_output

TWO_CORES = frozenset({2, 5})


def test_more_ranks_than_shared_cores_are_dealt_round_robin():
    assert [core_for_rank(i, [TWO_CORES] * 5) for i in range(5)] == [2, 5, 2, 5, 2]


def test_stages_are_mixed_on_each_core():
    # 2 stages x 2 replicas (rank = replica x 2 + stage): not both first stages on one core
    assert [core_for_rank(i, [TWO_CORES] * 4, [0, 1, 0, 1]) for i in range(4)] == [2, 5, 5, 2]
    # a 4-stage pipeline keeps neighbours apart; 2 x 3 on 2 cores: 3 ranks each, both stages
    assert deal_to_cores([0, 1, 2, 3], 2) == [0, 1, 0, 1]
    dealt = deal_to_cores([0, 1, 0, 1, 0, 1], 2)
    assert sorted(dealt) == [0, 0, 0, 1, 1, 1]
    assert all(
        {s for s, c in zip([0, 1] * 3, dealt, strict=True) if c == core} == {0, 1}
        for core in (0, 1)
    )
    # 3 stages x 3 replicas on 4 cores: as even as can be, no core with one stage thrice
    stages = [0, 1, 2] * 3
    dealt = deal_to_cores(stages, 4)
    assert sorted(dealt.count(c) for c in range(4)) == [2, 2, 2, 3]
    assert all(
        max([s for s, c in zip(stages, dealt, strict=True) if c == core].count(s) for s in range(3))
        < 3
        for core in range(4)
    )
    with pytest.raises(ValueError, match="2 stages given for 4"):
        core_for_rank(0, [TWO_CORES] * 4, [0, 1])


def test_a_core_per_rank_bound_ranks_and_the_opt_out_are_left_alone():
    assert core_for_rank(0, [TWO_CORES] * 2) is None  # not oversubscribed
    bound = [frozenset({2}), frozenset({5}), frozenset({2}), frozenset({5})]
    assert core_for_rank(1, bound) is None  # the launcher placed them
    assert core_for_rank(1, [TWO_CORES, TWO_CORES, frozenset({2}), TWO_CORES]) is None
    assert core_for_rank(3, [TWO_CORES] * 4, environ={"HYPARFLOW_PIN_RANKS": "0"}) is None
    assert core_for_rank(3, [TWO_CORES] * 4, environ={"HYPARFLOW_PIN_RANKS": "1"}) == 5
    with pytest.raises(ValueError, match="local rank 4"):
        core_for_rank(4, [TWO_CORES] * 4)


PROBE = """
import os, threading
from hyparflow.launch.affinity import pin_process
started, stop = threading.Event(), threading.Event()
def before():
    started.set()
    stop.wait()
    print(sorted(os.sched_getaffinity(0)))  # this thread's own mask
early = threading.Thread(target=before)
early.start()
started.wait()
core = max(os.sched_getaffinity(0))
count = pin_process(core)
later = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0))))
later.start(); later.join()
stop.set(); early.join()
print(count >= 2, core)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux thread affinity")
def test_pinning_reaches_threads_started_before_and_after():
    later, early, summary = python_output(PROBE).splitlines()
    pinned, core = summary.split()
    assert pinned == "True"
    assert later == early == f"[{core}]"


@pytest.mark.mpi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux thread affinity")
def test_fit_changes_no_process_state_unless_asked():
    """Default hf.fit on 4 ranks leaves affinity, glibc and page sizes alone; tune_process=True
    pins each rank's threads as `core_for_rank` deals them when ranks outnumber cores."""
    results = run_scenario("process_tuning", 4, timeout=240)
    cores = sorted(os.sched_getaffinity(0))
    for rank, result in enumerate(results):
        default, tuned = result["default"], result["tuned"]
        assert default["thread_cores"] == [result["launched"]], f"rank {rank} was re-bound"
        assert default["heap_kept"] is None, f"rank {rank}: mallopt called"
        assert default["huge_pages"] is False and "not requested" in default["huge_pages_reason"]
        assert tuned["heap_kept"] is True, rank
        stages = [Grid(2, 2).coords(r)[0] for r in range(4)]
        dealt = core_for_rank(rank, [frozenset(cores)] * 4, stages)
        expected = [[dealt]] if dealt is not None else [result["launched"]]
        assert tuned["thread_cores"] == expected, f"rank {rank}: {tuned}"

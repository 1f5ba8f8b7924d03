"""The multi-rank harness itself: a real 2-rank mpirun, alone or as a pool's job, and failures
that show every rank."""

import numpy as np
import pytest

from tests.support import pool
from tests.support.mpirun import launch, run_scenario

pytestmark = pytest.mark.mpi  # every test here starts MPI jobs


@pytest.mark.parametrize("pooled", [False, True], ids=["alone", "pooled"])
def test_two_ranks_see_each_other_and_move_tensors(pooled):
    results = run_scenario("world_roundtrip", 2, pooled=pooled)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 for r in results)
    base = np.arange(6)
    for r in results:
        source = (r["rank"] - 1) % 2
        np.testing.assert_array_equal(r["received"], base + 100 * source)
        np.testing.assert_array_equal(r["allreduced"], 2 * base + 100)


@pytest.mark.parametrize("pooled", [False, True], ids=["alone", "pooled"])
def test_failing_rank_is_reported_with_its_stderr(pooled):
    run = launch("fail_on_rank1", 2, timeout=120, pooled=pooled)
    assert run.returncode != 0
    assert run.results[0] is not None and run.results[1] is None
    assert "deliberate failure on rank 1" in run.stderr[1]
    with pytest.raises(AssertionError, match="deliberate failure on rank 1"):
        run_scenario("fail_on_rank1", 2, timeout=120, pooled=pooled)


def test_a_pool_runs_jobs_in_turn_and_a_failed_job_ends_it():
    """Jobs reuse the ranks (one TensorFlow start); after a failure the next job gets new ones,
    and each job's output is its own."""
    run_scenario("world_roundtrip", 2, pooled=True)
    ranks = pool.running(2)
    run = launch("world_roundtrip", 2, pooled=True)
    assert run.returncode == 0 and pool.running(2) is ranks
    assert "deliberate failure" not in run.stderr[1]
    assert launch("fail_on_rank1", 2, pooled=True).returncode != 0
    assert pool.running(2) is None
    run_scenario("world_roundtrip", 2, pooled=True)
    assert pool.running(2) not in (None, ranks)

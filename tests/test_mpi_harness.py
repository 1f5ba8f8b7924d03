"""The multi-rank harness itself: a real 2-rank mpirun, and failures that show every rank."""

import numpy as np
import pytest

from tests.support.mpirun import launch, run_scenario

pytestmark = pytest.mark.mpi  # every test here starts MPI jobs


def test_two_ranks_see_each_other_and_move_tensors():
    results = run_scenario("world_roundtrip", 2)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 for r in results)
    base = np.arange(6)
    for r in results:
        source = (r["rank"] - 1) % 2
        np.testing.assert_array_equal(r["received"], base + 100 * source)
        np.testing.assert_array_equal(r["allreduced"], 2 * base + 100)


def test_failing_rank_is_reported_with_its_stderr():
    run = launch("fail_on_rank1", 2, timeout=120)
    assert run.returncode != 0
    assert run.results[0] is not None and run.results[1] is None
    assert "deliberate failure on rank 1" in run.stderr[1]
    with pytest.raises(AssertionError, match="deliberate failure on rank 1"):
        run_scenario("fail_on_rank1", 2, timeout=120)

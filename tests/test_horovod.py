"""hf.fit(comm="horovod") trains to the weights of comm="mpi" and of Keras; without Horovod it
is a clear error on every rank.

The equivalence tests need Horovod, which only `make test-compat` builds (in .venv-compat, on
TensorFlow 2.17); the main venv runs the missing-Horovod test instead.
"""

import importlib.util

import pytest
from mpi4py import MPI

from hyparflow.comm.allreduce import GradientReducer
from hyparflow.comm.backends import check_backend, make_reducer
from hyparflow.comm.topology import Topology
from tests.support.cases import Case
from tests.support.equivalence import assert_within, launched
from tests.support.mpirun import run_scenario

pytestmark = pytest.mark.mpi  # every test here starts MPI jobs

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None
needs_horovod = pytest.mark.skipif(
    not HAVE_HOROVOD,
    reason="Horovod is not installed in this venv; `make test-compat` builds it and runs this",
)

# Case(model, optimizer, kind, ...): models and optimizers of tests/support/models.py
TWO_RANKS = [
    Case("mlp", "sgd", "data", replicas=2),
    # row-sparse table gradients: gathered over MPI
    Case("embedding", "adam", "data", replicas=2, microbatches=2),
    Case("cnn", "adam", "data", replicas=2),
    Case("shared", "sgd", "data", replicas=2),
]
FOUR_RANKS = [
    Case("mlp", "adam", "hybrid", partitions=2, replicas=2, microbatches=2, schedule="1f1b"),
    Case("resnet", "sgd", "hybrid", partitions=2, replicas=2, microbatches=2),
    # a second grid in the same processes: new process sets
    Case("mlp", "adam", "data", replicas=4),
    # the first grid again: its process sets are reused
    Case("l2_mlp", "sgd", "hybrid", partitions=2, replicas=2, schedule="1f1b"),
    # one replica per stage: nothing for Horovod to sum
    Case("mlp", "sgd", "model", partitions=4, microbatches=2),
]
TOLERANCE = 1e-5


two_ranks = launched("horovod_fit", 2, TWO_RANKS, timeout=540)
four_ranks = launched("horovod_fit", 4, FOUR_RANKS, timeout=840)


def _check(case, ranks):
    assert_within(
        ranks,
        TOLERANCE,
        "horovod_vs_mpi",
        "horovod_vs_keras",
        "mpi_vs_keras",
        "history_vs_keras",
        "predict_vs_mpi",
    )
    for r in ranks:
        where = f"rank {r['rank']}"
        assert r["reducer"] == "HorovodReducer", where
        assert (r["horovod_calls"] > 0) == (case.replicas > 1), f"{where}: {r['horovod_calls']}"


@needs_horovod
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", TWO_RANKS, ids=str)
def test_horovod_data_parallel_two_ranks_matches_mpi_and_keras(two_ranks, case):
    _check(case, two_ranks[case.id])


@needs_horovod
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", FOUR_RANKS, ids=str)
def test_horovod_hybrid_four_ranks_matches_mpi_and_keras(four_ranks, case):
    _check(case, four_ranks[case.id])


def test_backends_are_checked_and_mpi_is_the_fused_reducer():
    with pytest.raises(ValueError, match=r"comm must be one of \('mpi', 'horovod'\)"):
        check_backend("nccl")
    reducer = make_reducer("mpi", Topology.create(MPI.COMM_SELF, 1, 1), [((2,), "float32")])
    assert isinstance(reducer, GradientReducer) and reducer.op == "sum"


@needs_horovod
@pytest.mark.timeout(300)
def test_horovod_reducer_handles_none_half_precision_and_sparse_like_mpi():
    for result in run_scenario("horovod_fit", 2, "reducer", timeout=240):
        for op in ("sum", "mean"):
            assert result[op]["equal"], (result["rank"], op, result[op])
            assert result[op]["none_kept"]
            assert result[op]["dtypes"] == ["float32", None, "float16", "float32"]


@pytest.mark.skipif(HAVE_HOROVOD, reason="Horovod is installed here, so it cannot be missing")
@pytest.mark.timeout(120)
def test_missing_horovod_is_a_clear_error_on_every_rank():
    results = run_scenario("horovod_fit", 2, "missing", timeout=100)
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank} trained without Horovod"
        assert error.startswith("ImportError: comm='horovod' needs Horovod"), error
        assert "scripts/build_horovod.sh" in error and "docs/horovod.md" in error, error

"""Misuse gets a clear error on every rank and no hang (tests/mpi/misuse.py).

Every case runs in one 2-rank job: each is caught on both ranks and the next case trains on the
same ranks, which shows that the error left nothing blocked. A few run uncaught in jobs of
their own, to show that each rank then ends by itself.
"""

import pytest

from tests.support.mpirun import launch, run_scenario

pytestmark = pytest.mark.mpi  # every test here starts MPI jobs


@pytest.fixture(scope="module")
def misuse_errors(tmp_path_factory) -> list[dict]:
    """Each rank's error for every case of tests/mpi/misuse.py, all cases in one 2-rank job."""
    scratch = str(tmp_path_factory.mktemp("misuse"))
    return [r["errors"] for r in run_scenario("misuse", 2, "all", scratch, timeout=300)]


MISUSE = {
    "wrong_world_size": "mpirun -np 6",
    "batch_not_divisible": "use a multiple of 4",
    "subclassed_model_parallel": 'strategy="data"',
    "uncompiled": "model.compile",
    "unknown_strategy": "Unknown strategy kind 'pipeline'",
    "mismatched_lengths": "same number of samples",
    "wrong_input_shape": "does not fit the model input",
    "missing_split_layer": "no_such_layer",
    "empty_dataset": "Pass at least one batch",
    "nonfinite_data": "NaN or Inf",
    "own_train_step": "overrides Model.train_step",
    "unsliceable_noise": "['noise']",
    "synchronized_batchnorm_microbatches": "use num_microbatches=1",
    "sum_reduction": "reduction='sum_over_batch_size'",
    "global_mean_microbatches": "hf.global_mean needs the whole global batch",
    "strict_added_losses": "strict_added_losses=True refuses them",
    "replica_without_rows": "leaves some of the 2 replicas without rows",
    # every rank raised it mid-step: an ordinary exception everywhere, not MPI_Abort
    "same_error_everywhere": "boom: this layer cannot train",
    "caught_and_continued": "recovered: trained 1 epoch after the error",
    # one stage or replica raised mid-step: its error there, RemoteRankError naming it elsewhere
    "one_stage_fails_mid_step": "this stage failed mid-step",
    "one_replica_fails_mid_step": "this stage failed mid-step",
    "caught_mid_step_and_continued": "recovered: trained 1 epoch after the error",
    "foreign_checkpoint": "different model",
    "corrupted_checkpoint": "corrupted",
    "missing_checkpoint": "No complete checkpoint",
    "resume_without_checkpoint_callback": "hf.callbacks.Checkpoint",
    "negative_watchdog": "watchdog_timeout must be >= 0",
    "different_data_on_each_rank": "differs across ranks: ranks [0] vs [1].",
    "diverging_training": "Non-finite",
}


@pytest.mark.parametrize("case", MISUSE)
def test_misuse_is_a_clear_error_on_every_rank(case, misuse_errors):
    """Every case in one job (tests/conftest.py): each error reached both ranks, and the next
    case trained on the same ranks."""
    for rank, errors in enumerate(misuse_errors):
        assert errors[case] is not None, f"{case} did not raise on rank {rank}"
        assert MISUSE[case] in errors[case], f"{case}, rank {rank}: {errors[case]}"
    if case == "diverging_training":  # the step, rank and stage are named
        assert all("at step" in e[case] and "pipeline stage" in e[case] for e in misuse_errors)
    if case in ("one_stage_fails_mid_step", "one_replica_fails_mid_step"):
        kinds = sorted(e[case].split(":")[0] for e in misuse_errors)
        assert kinds == ["InvalidArgumentError", "RemoteRankError"], misuse_errors
        failed = next(r for r, e in enumerate(misuse_errors) if e[case].startswith("Invalid"))
        remote = next(e[case] for e in misuse_errors if e[case].startswith("Remote"))
        assert remote.startswith(f"RemoteRankError: rank {failed} failed: Invalid"), remote


@pytest.mark.parametrize(
    "case", ["wrong_world_size", "same_error_everywhere", "one_stage_fails_mid_step"]
)
def test_an_uncaught_misuse_ends_every_rank_by_itself(case, tmp_path):
    """Uncaught, an error found before training, one raised mid-step on every rank, and one
    raised mid-step by one stage end the job: each rank exits non-zero by itself with its error
    (no MPI_Abort, no rank blocked); a failing stage says so at once."""
    run = launch("misuse", 2, case, str(tmp_path), timeout=60)
    assert run.returncode not in (0, -9), f"{case}: exit {run.returncode}\n{run.describe()}"
    for rank, result in enumerate(run.results):
        assert result is not None, f"{case}: rank {rank} reported nothing\n{run.describe()}"
        assert MISUSE[case] in (result["error"] or ""), f"{case}, rank {rank}: {result}"
        assert "MPI_ABORT" not in run.stderr[rank], run.describe()
    if case == "one_stage_fails_mid_step":
        said = [line for err in run.stderr for line in err.splitlines() if "stopping" in line]
        assert len(said) == 1 and said[0].startswith("hyparflow rank "), said
        assert "this stage failed mid-step : Tensor had NaN values" in said[0], said


TENSOR_MISUSE = {
    "tensor_indivisible_units": "'five_units', but its 5 units are not a multiple of tensor=2",
    "tensor_not_dividing_world": "tensor=3 does not divide the world size 2",
}


@pytest.mark.parametrize("case", TENSOR_MISUSE)
def test_tensor_misconfiguration_is_a_clear_error_on_every_rank(case, misuse_errors):
    for rank, errors in enumerate(misuse_errors):
        assert TENSOR_MISUSE[case] in (errors[case] or ""), f"{case}, rank {rank}: {errors[case]}"

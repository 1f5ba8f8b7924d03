"""Every input `model.fit` takes gives Keras's weights and History under `hf.fit` on 2 ranks,
in the data (R=2) and model (P=2) layouts, and each way data comes in under tensor (T=2) and,
on 4 ranks, hybrid (P2 x R2); `evaluate` and `predict` match too; what Keras refuses is refused
with its message. One launch per rank count runs tests/mpi/data_inputs.py's cases
(docs/keras_parity.md)."""

import pytest

from tests.mpi.data_inputs import CASES, EVALUATED, EVERY_CASE, REFUSED, WAYS_IN
from tests.mpi.data_inputs import PER_OUTPUT_LOSS_WEIGHTS as LOSS_WEIGHTS
from tests.support.custom_steps import CASES as CUSTOM_STEPS
from tests.support.custom_steps import MIXED_TOLERANCE, SHARDED, SHARDED_REFUSED
from tests.support.custom_steps import REFUSED as CUSTOM_REFUSED
from tests.support.mpirun import run_scenario

pytestmark = pytest.mark.mpi  # every test here starts MPI jobs

TOLERANCE = 1e-5


def _outcomes(np: int, *kinds: str, timeout: float):
    ranks = run_scenario("data_inputs", np, *kinds, timeout=timeout)
    return {r["case"]: r for r in ranks[0]["results"] + ranks[0]["refusals"]}, ranks


@pytest.fixture(scope="module")
def outcomes():
    return _outcomes(2, "data", "model", "tensor", timeout=900)


@pytest.fixture(scope="module")
def hybrid_outcomes():
    return _outcomes(4, "hybrid", timeout=900)


def _of(request, kind: str):
    """The launch that ran `kind`'s cells: the 4-rank one for hybrid, else the 2-rank one."""
    return request.getfixturevalue("hybrid_outcomes" if kind == "hybrid" else "outcomes")


LAYOUTS = ("data", "model", "tensor", "hybrid")
CELLS = [(kind, case) for kind in EVERY_CASE for case in sorted(CASES)] + [
    (kind, case) for kind in LAYOUTS if kind not in EVERY_CASE for case in WAYS_IN
]


@pytest.mark.timeout(1000)
@pytest.mark.parametrize(("kind", "case"), CELLS)
def test_fit_matches_keras(request, kind, case):
    results, ranks = _of(request, kind)
    result = results[f"{kind}:{case}"]
    assert result["keys"][0] == result["keys"][1], result
    assert result["epochs"][0] == result["epochs"][1], result
    assert result["weights"] < TOLERANCE, result
    assert result["history"] < TOLERANCE, result
    assert all(r["results"] == ranks[0]["results"] for r in ranks)  # the same model everywhere


@pytest.mark.parametrize("kind", ["data", "model"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_keras_refuses_is_refused_with_its_message(outcomes, kind, case):
    result = outcomes[0][f"{kind}:{case}"]
    assert result["keras"] is not None, result  # Keras does refuse it
    assert result["hyparflow"] == result["keras"], result


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("kind", ["data", "model", "hybrid"])
def test_per_output_losses_follow_keras(request, kind):
    """Per-output History (validation included) and evaluate with a partial last batch."""
    results, ranks = _of(request, kind)
    result = results[f"{kind}:per_output_losses"]
    assert result["keys"][0] == result["keys"][1], result
    assert {"regression_loss", "val_classes_loss"} <= set(result["keys"][0]), result
    assert result["epochs"][0] == result["epochs"][1], result
    for part in ("weights", "history", "evaluate"):
        assert result[part] < TOLERANCE, (part, result)
    # the case tells weightings apart: Keras's per-output means, counting the last batch once,
    # do not add up to its total loss, which weighs each batch by its rows
    keras_logs = result["reference"]
    for epoch, total in enumerate(keras_logs["loss"]):
        parts = sum(w * keras_logs[f"{name}_loss"][epoch] for name, w in LOSS_WEIGHTS.items())
        assert abs(parts - total) > 1e-3 * total, keras_logs
    assert all(r["results"] == ranks[0]["results"] for r in ranks)


@pytest.mark.parametrize("case", sorted(CUSTOM_STEPS))
def test_a_custom_step_trains_as_keras_under_data_parallelism(outcomes, case):
    """An overridden train_step / compute_loss: weights, History (validation included) and
    evaluate equal Keras on the global batch; no optimizer is left patched afterwards."""
    results, ranks = outcomes
    result = results[f"data:{case}"]
    assert result["keys"][0] == result["keys"][1], result
    assert result["epochs"][0] == result["epochs"][1], result
    assert result["weights"] < TOLERANCE and result["history"] < TOLERANCE, result
    assert result["unpatched"], result
    assert all(r["results"] == ranks[0]["results"] for r in ranks)


@pytest.mark.parametrize("case", sorted(CUSTOM_REFUSED))
def test_a_custom_step_that_cannot_equal_keras_is_refused(outcomes, case):
    strategy, _, says = CUSTOM_REFUSED[case]
    result = outcomes[0][f"{strategy}:{case}"]
    assert result["error"] is not None and says in result["error"], result


REPLICA_LAUNCHES = ["outcomes", "hybrid_outcomes"]  # every rank a replica: R=2 and R=4


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("launch", REPLICA_LAUNCHES)
@pytest.mark.parametrize("case", sorted(SHARDED))
def test_a_custom_step_trains_as_keras_with_a_slice_of_the_optimizer_state(request, launch, case):
    """ZeRO-1/2/3 under the model's own step: each optimizer it applies (the compiled one,
    those held as attributes, a GAN's two) steps each replica's slices of the variables it is
    applied to (sharded_optimizer/step_optimizers.py), which hold 1/R of its slots, up to
    padding; under ZeRO-3 the variables hold the weights inside each step alone."""
    results, ranks = request.getfixturevalue(launch)
    result = results[f"sharded:{case}"]
    tolerance = MIXED_TOLERANCE if "mixed" in case else TOLERANCE
    assert result["weights"] < tolerance and result["history"] < tolerance, result
    assert result["slot_ratios"], result  # every case's step applies an optimizer with slots
    assert all(abs(r - 1 / len(ranks)) < 0.02 for r in result["slot_ratios"]), result
    # rank 0's saved files hold every optimizer's whole state, as Keras's fit leaves it
    assert result["saved_optimizers"] < tolerance, result
    assert result["unpatched"], result
    # ZeRO-3: between steps the weights are only the replicas' slices
    assert set(result["held_between_steps"]) == {"shard_weights" not in case}, result
    assert all(r["results"] == ranks[0]["results"] for r in ranks)


def test_a_sharded_custom_step_resumes_as_an_unsharded_one(outcomes):
    """`ExtraUpdate` under ZeRO-3 resumed from an hf checkpoint (the compiled optimizer's
    slices restored) trains on as the same model resumed without sharding."""
    result = outcomes[0]["sharded:custom_step_extra_update_resumed_shard_weights"]
    assert result["batches_run"] == [4, 4], result  # each resumed for the second epoch alone
    assert result["weights"] < TOLERANCE, result


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("launch", REPLICA_LAUNCHES)
@pytest.mark.parametrize("case", sorted(SHARDED_REFUSED))
def test_a_custom_step_that_sharding_cannot_train_is_refused(request, launch, case):
    results, ranks = request.getfixturevalue(launch)
    says = SHARDED_REFUSED[case][2]
    for rank in ranks:
        error = {r["case"]: r for r in rank["results"]}[f"sharded:{case}"]["error"]
        assert error is not None and says in error, (rank["rank"], error)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("case", sorted(EVALUATED))
def test_evaluate_and_predict_match_keras(request, kind, case):
    results, ranks = _of(request, kind)
    result = results[f"{kind}:evaluate_predict_{case}"]
    assert result["keys"][0] == result["keys"][1], result
    assert result["shapes"][0] == result["shapes"][1], result
    assert result["evaluate"] < TOLERANCE and result["predict"] < TOLERANCE, result
    assert all(r["results"] == ranks[0]["results"] for r in ranks)

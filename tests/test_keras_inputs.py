"""Every input `model.fit` takes gives Keras's weights and History under `hf.fit` on 2 ranks,
in the data (R=2) and model (P=2) layouts, and each way data comes in under tensor (T=2);
`evaluate` and `predict` match too; what Keras refuses is refused with its message.
One launch runs every case of tests/mpi/data_inputs.py (docs/keras_parity.md)."""

import pytest

from tests.mpi.data_inputs import CASES, EVALUATED, REFUSED, TENSOR_CASES
from tests.mpi.data_inputs import PER_OUTPUT_LOSS_WEIGHTS as LOSS_WEIGHTS
from tests.support.custom_steps import CASES as CUSTOM_STEPS
from tests.support.custom_steps import REFUSED as CUSTOM_REFUSED
from tests.support.mpirun import run_scenario

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def outcomes():
    ranks = run_scenario("data_inputs", 2, "data", "model", "tensor", timeout=900)
    return {r["case"]: r for r in ranks[0]["results"] + ranks[0]["refusals"]}, ranks


CELLS = [(kind, case) for kind in ("data", "model") for case in sorted(CASES)] + [
    ("tensor", case) for case in TENSOR_CASES
]


@pytest.mark.parametrize(("kind", "case"), CELLS)
def test_fit_matches_keras(outcomes, kind, case):
    results, ranks = outcomes
    result = results[f"{kind}:{case}"]
    assert result["keys"][0] == result["keys"][1], result
    assert result["epochs"][0] == result["epochs"][1], result
    assert result["weights"] < TOLERANCE, result
    assert result["history"] < TOLERANCE, result
    assert ranks[1]["results"] == ranks[0]["results"]  # every rank ends with the same model


@pytest.mark.parametrize("kind", ["data", "model"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_keras_refuses_is_refused_with_its_message(outcomes, kind, case):
    result = outcomes[0][f"{kind}:{case}"]
    assert result["keras"] is not None, result  # Keras does refuse it
    assert result["hyparflow"] == result["keras"], result


@pytest.mark.parametrize("kind", ["data", "model"])
def test_per_output_losses_follow_keras(outcomes, kind):
    """Per-output History (validation included) and evaluate with a partial last batch."""
    results, ranks = outcomes
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
    assert ranks[1]["results"] == ranks[0]["results"]


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
    assert ranks[1]["results"] == ranks[0]["results"]


@pytest.mark.parametrize("case", sorted(CUSTOM_REFUSED))
def test_a_custom_step_that_cannot_equal_keras_is_refused(outcomes, case):
    strategy, _, says = CUSTOM_REFUSED[case]
    result = outcomes[0][f"{strategy}:{case}"]
    assert result["error"] is not None and says in result["error"], result


@pytest.mark.parametrize("kind", ["data", "model", "tensor"])
@pytest.mark.parametrize("case", sorted(EVALUATED))
def test_evaluate_and_predict_match_keras(outcomes, kind, case):
    results, ranks = outcomes
    result = results[f"{kind}:evaluate_predict_{case}"]
    assert result["keys"][0] == result["keys"][1], result
    assert result["shapes"][0] == result["shapes"][1], result
    assert result["evaluate"] < TOLERANCE and result["predict"] < TOLERANCE, result
    assert ranks[1]["results"] == ranks[0]["results"]

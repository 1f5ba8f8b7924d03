"""Every input `model.fit` takes gives Keras's weights and History under `hf.fit` on 2 ranks,
in the data (R=2) and model (P=2) layouts; what Keras refuses is refused with its message.
One launch runs every case of tests/mpi/data_inputs.py (docs/keras_parity.md)."""

import pytest

from tests.mpi.data_inputs import CASES, REFUSED
from tests.support.mpirun import run_scenario

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def outcomes():
    ranks = run_scenario("data_inputs", 2, "data", "model", timeout=600)
    return {r["case"]: r for r in ranks[0]["results"] + ranks[0]["refusals"]}, ranks


@pytest.mark.parametrize("kind", ["data", "model"])
@pytest.mark.parametrize("case", sorted(CASES))
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

"""The equivalence cases (tests/support/cases.py): their layout is hf.Strategy's own fields."""

import dataclasses

import pytest

import hyparflow as hf
from tests.support.cases import Case


def test_every_strategy_field_is_a_case_field_and_reaches_the_strategy():
    case_fields = {f.name for f in dataclasses.fields(Case)}
    strategy_fields = {f.name for f in dataclasses.fields(hf.Strategy)}
    assert strategy_fields <= case_fields
    own = {"model", "optimizer", "policy", "large_variables", "one_step"}
    assert case_fields - strategy_fields == own
    layout = {"partitions": 2, "replicas": 2, "microbatches": 2, "schedule": "1f1b"}
    options = {"overlap_p2p": False, "update_by_segment": True, "balance": "time"}
    case = Case("mlp", "adam", "hybrid", **layout, **options)
    assert hf.Strategy(**case.strategy_options()) == hf.Strategy("hybrid", **layout, **options)
    assert case.id == "mlp-adam-hybrid-P2R2-M2-1f1b-blocking-bysegment-balance=time"
    assert Case.from_json(case.to_json()) == case


def test_a_strategy_option_that_does_not_exist_is_refused_by_the_case():
    with pytest.raises(TypeError, match="microbatch"):
        Case("mlp", "adam", "data", microbatch=2)

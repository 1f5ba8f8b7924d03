"""Strategy validation and resolution against a world size."""

import re

import pytest

from hyparflow import Strategy
from hyparflow.spelling import Spelling
from hyparflow.strategy import make_strategy


@pytest.mark.parametrize(
    "strategy, world, expected",
    [
        (Strategy("data"), 4, ("data", 1, 4)),
        (Strategy("model"), 4, ("model", 4, 1)),
        (Strategy("hybrid", partitions=2), 8, ("hybrid", 2, 4)),
        (Strategy("hybrid", replicas=2), 8, ("hybrid", 4, 2)),
        (Strategy("hybrid", partitions=2, replicas=2), 4, ("hybrid", 2, 2)),
        (Strategy("auto"), 3, ("data", 1, 3)),
        (Strategy("auto", partitions=3), 3, ("model", 3, 1)),
        (Strategy("auto", partitions=2), 4, ("hybrid", 2, 2)),
        (Strategy("auto"), 1, ("data", 1, 1)),
    ],
)
def test_resolve(strategy, world, expected):
    resolved = strategy.resolve(world)
    assert (resolved.kind, resolved.partitions, resolved.replicas) == expected


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Strategy("pipeline"), "Unknown strategy kind 'pipeline'"),
        (lambda: Strategy("model", partitions=0), "positive integer"),
        (lambda: Strategy("model", partitions=2.0), "positive integer"),
        (lambda: Strategy("hybrid", replicas=True), "positive integer"),
        (lambda: Strategy("data", microbatches=-1), "positive integer"),
        (lambda: Strategy("model", schedule="zigzag"), "Unknown schedule"),
        (lambda: Strategy("model", balance="random"), "Unknown balance"),
        (lambda: Strategy("data", partitions=2), "use strategy 'model' or 'hybrid'"),
        (lambda: Strategy("model", replicas=2), "use strategy 'hybrid'"),
        (lambda: Strategy("hybrid", partitions=2, replicas=3).resolve(4), "mpirun -np 6"),
        (lambda: Strategy("hybrid", partitions=3).resolve(4), "does not divide"),
        (lambda: Strategy("hybrid").resolve(4), "needs partitions or replicas"),
        (lambda: Strategy("model", partitions=2).resolve(4), "mpirun -np 2"),
        (lambda: make_strategy(42), "must be a string or hf.Strategy"),
        (lambda: Strategy("data", update_by_segment="yes"), "must be True, False or None"),
        # ZB-H1's weight gradients are final only after the backward
        (lambda: Strategy("model", schedule="zero_bubble", overlap_groups=2), "overlap_groups=1"),
        (lambda: Strategy("model", schedule="zero_bubble", update_by_segment=True), "by segment"),
        (lambda: Strategy("hybrid", schedule="zero_bubble", tensor=2), "tensor=1"),
        # interleaved: chunks neither split over tensor ranks nor cut into segments
        (lambda: Strategy("hybrid", schedule="interleaved", tensor=2), "with tensor > 1"),
        (lambda: Strategy("model", schedule="interleaved", overlap_groups=2), "overlap_groups"),
        (lambda: Strategy("model", schedule="interleaved", update_by_segment=True), "segment"),
        (lambda: Strategy("model", schedule="1f1b", virtual_stages=2), "needs schedule="),
        (lambda: Strategy("model", schedule="interleaved", virtual_stages=0), "positive"),
    ],
)
def test_invalid_strategies_name_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "strategy, launch, said",
    [
        ("hybrid", "mpirun -np {ranks}", "launch with `mpirun -np 6` or change num_partitions/"),
        (
            Strategy("hybrid"),
            "hyparflow run -n {ranks}",
            "launch with `hyparflow run -n 6` or change partitions/replicas",
        ),
        ("hybrid", "srun -n {ranks}", "`srun -n 6` or change num_partitions/num_replicas"),
    ],
)
def test_hints_name_the_keywords_and_the_launcher_the_user_wrote(strategy, launch, said):
    """`hf.fit(strategy="hybrid", num_partitions=2, ...)` and `hf.Strategy(partitions=2)` are
    told their own keywords; `hyparflow run` and srun jobs their own command."""
    spelling = Spelling.of(isinstance(strategy, str), launch)
    with pytest.raises(ValueError, match=re.escape(said)):
        Strategy("hybrid", partitions=2, replicas=3).resolve(4, spelling)
    hybrid = "needs num_partitions or num_replicas" if strategy == "hybrid" else "needs partitions"
    with pytest.raises(ValueError, match=hybrid):
        Strategy("hybrid").resolve(4, spelling)


def test_interleaved_holds_two_chunks_a_stage_unless_told():
    assert Strategy("model", schedule="interleaved").virtual_stages == 2
    assert Strategy("model", schedule="interleaved", virtual_stages=3).virtual_stages == 3
    assert Strategy("model", schedule="1f1b").virtual_stages == 1


def test_memory_plan_takes_the_interleaved_default_of_two_chunks_a_stage():
    import keras

    import hyparflow as hf

    model = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(4) for _ in range(4)])
    strategy = Strategy("model", partitions=2, schedule="interleaved")  # virtual_stages: 2
    plan = hf.memory_plan(model, strategy, batch_size=8, runtime=False)
    assert "interleaved (v=2)" in plan.summary(print_fn=None)
    assert [r.weights for r in plan.ranks] == [2 * 20 * 4] * 2  # two 4x4 Dense layers each


def test_hyparflow_keyword_names_fill_the_strategy():
    s = make_strategy("hybrid", num_partitions=2, num_replicas=3, num_microbatches=4)
    assert (s.partitions, s.replicas, s.microbatches) == (2, 3, 4)
    base = Strategy("model", schedule="1f1b")
    s = make_strategy(base, num_microbatches=8)
    assert (s.kind, s.schedule, s.microbatches) == ("model", "1f1b", 8)
    assert make_strategy(base) is base


def test_batchnorm_by_parts_of_the_batch_is_said_unless_synchronised_or_frozen():
    """Rank 0 says, when training starts, which BatchNormalization layers normalise each
    replica's or micro-batch's share by its own statistics (hyparflow's default)."""
    import keras

    from hyparflow.model_checks import batchnorm_notice

    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization(name="norm")(keras.layers.Dense(4)(inputs))
    frozen = keras.layers.BatchNormalization(name="frozen", trainable=False)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1)(frozen))
    data = Strategy("data").resolve(2)
    notice = batchnorm_notice(model, data)
    assert "['norm']" in notice and "replica's share" in notice and "sync_batchnorm" in notice
    assert batchnorm_notice(model, Strategy("data", sync_batchnorm=True).resolve(2)) is None
    assert batchnorm_notice(model, Strategy("model").resolve(2)) is None  # one micro-batch
    pipeline = Strategy("model", microbatches=2).resolve(2)
    assert "micro-batch's share" in batchnorm_notice(model, pipeline)

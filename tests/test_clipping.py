"""Which clipping a stage's update does (engine/gradients/clipping.py): one rule, as a table."""

import pytest

from hyparflow.engine.gradients.clipping import RANKS, STAGE, Clipping, decide_clipping

# clipnorm, global_clipnorm, partitioned, split variables -> the clipping
TABLE = [
    (None, None, False, False, Clipping()),
    (None, None, True, True, Clipping()),
    (0.0, 0.0, True, False, Clipping()),  # Keras's 0 means unset too
    # global_clipnorm: Keras's own norm where the stage is the whole model, else over the ranks
    (None, 1.0, False, False, Clipping(global_norm_over=STAGE)),
    (None, 1.0, True, False, Clipping(global_norm_over=RANKS)),
    (None, 1.0, False, True, Clipping(global_norm_over=RANKS)),
    (None, 1.0, True, True, Clipping(global_norm_over=RANKS)),
    # clipnorm: each variable alone, Keras's own, unless a shard must use its whole variable's
    (0.5, None, False, False, Clipping(per_variable=True)),
    (0.5, None, True, False, Clipping(per_variable=True)),
    (0.5, None, False, True, Clipping(per_variable=True, shards_by_whole_variable=True)),
]


@pytest.mark.parametrize("clipnorm, global_clipnorm, partitioned, split, expected", TABLE)
def test_the_clipping_of_a_stage(clipnorm, global_clipnorm, partitioned, split, expected):
    decided = decide_clipping(
        clipnorm, global_clipnorm, partitioned=partitioned, split_variables=split
    )
    assert decided == expected


@pytest.mark.parametrize(
    "clipping, by_global_norm, needs_every_gradient",
    [
        (Clipping(), False, False),
        (Clipping(per_variable=True), False, False),  # an update in parts can clip each part
        (Clipping(global_norm_over=STAGE), True, True),
        (Clipping(per_variable=True, shards_by_whole_variable=True), False, True),
    ],
)
def test_what_a_clipping_asks_of_the_update(clipping, by_global_norm, needs_every_gradient):
    assert clipping.by_global_norm == by_global_norm
    assert clipping.needs_every_gradient == needs_every_gradient

"""Expert parallelism's pieces in one process: the in-graph all-to-all, the mixture over an
expert group, the refusals and the gradient form (the multi-rank runs against Keras are in
tests/test_real_models.py and tests/test_reliability.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hyparflow as hf
from hyparflow.comm.in_graph import exchange, traffic
from hyparflow.engine.gradients.form import GradientForm, choose_gradient_form
from hyparflow.model_checks import check_expert_parallel, check_layout, training_notices
from hyparflow.moe import expert_weights
from hyparflow.moe.dispatch import top_k_mixture
from hyparflow.moe.expert_parallel import expert_parallel_mixture
from tests.support import zoo

TOLERANCE = 1e-6


def test_an_exchange_on_one_rank_returns_every_row_and_counts_its_bytes():
    rows = tf.constant(np.arange(12.0).reshape(4, 3), tf.float32)
    ids = tf.constant([3, 1, 2, 0], tf.int32)
    before = traffic("experts").bytes
    counts, (back, back_ids) = exchange(
        MPI.COMM_SELF, tf.constant([4], tf.int32), [rows, ids], "experts"
    )
    assert counts.numpy().tolist() == [4]
    np.testing.assert_array_equal(back, rows)
    np.testing.assert_array_equal(back_ids, ids)
    assert traffic("experts").bytes - before == rows.numpy().nbytes + ids.numpy().nbytes


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_the_mixture_over_one_rank_equals_the_local_one_with_gradients(capacity_factor):
    rng = np.random.default_rng(3)
    experts, rows, picks = 4, 10, 2
    tokens = tf.constant(rng.normal(size=(rows, 5)), tf.float32)
    kernels = tf.Variable(rng.normal(size=(experts, 5, 3)), dtype=tf.float32)
    index = tf.constant(np.stack([rng.permutation(experts)[:picks] for _ in range(rows)]))
    weight = tf.constant(rng.uniform(size=(rows, picks)), tf.float32)
    expert = lambda e, x: x @ tf.unstack(kernels.value())[e]  # noqa: E731
    results = []
    for mixture in (
        lambda: expert_parallel_mixture(
            tokens, index, weight, experts, expert, MPI.COMM_SELF, capacity_factor
        ),
        lambda: top_k_mixture(tokens, index, weight, experts, expert, capacity_factor),
    ):
        with tf.GradientTape() as tape:
            tape.watch([tokens, weight])
            loss = tf.reduce_sum(mixture() * tf.range(1.0, 4.0))
        results.append(
            [tf.convert_to_tensor(g) for g in tape.gradient(loss, [tokens, weight, kernels])]
        )
        results[-1].append(loss)
    for parallel, local in zip(*results, strict=True):
        np.testing.assert_allclose(parallel, local, atol=TOLERANCE, rtol=TOLERANCE)


def test_the_strategy_refuses_expert_counts_and_settings_it_cannot_split():
    assert hf.Strategy("data", experts=2).resolve(4).experts == 2
    assert hf.Strategy("data", replicas=2, tensor=2, experts=2).resolve(4).experts == 2
    assert hf.Strategy("data", experts=2, shard_optimizer=True).resolve(4).shard_optimizer
    for options, words in [
        (dict(replicas=4, experts=3), "must divide replicas=4"),
        (dict(experts=2, sparse_experts=False), "sparse_experts=False"),
        (dict(experts=0), "positive integer"),
        (dict(capacity_factor=0), "positive number"),
        (dict(capacity_factor=True), "positive number"),
        (dict(capacity_factor=float("inf")), "positive number"),
        (dict(capacity_factor=1.25, sparse_experts=False), "needs sparse_experts=True"),
    ]:
        with pytest.raises(ValueError, match=words):
            hf.Strategy("data", **options)
    with pytest.raises(ValueError, match="does not divide the 3 replicas"):
        hf.Strategy("data", experts=2).resolve(3)
    # an open "auto" leaves the layout to the planner, which does not split experts
    assert not hf.Strategy(experts=2).leaves_layout_open()


def test_expert_shards_reduce_as_a_list_after_the_backward():
    facts = dict(partitioned=False, replicas=4, dense_variables=9, overlap_groups=4, segments=4)
    assert choose_gradient_form(**facts) != GradientForm()
    assert choose_gradient_form(**facts, expert_split=True) == GradientForm()


def _compiled_mixtral(optimizer):
    model = zoo.mixtral()
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


def test_a_capacity_factor_is_announced_as_training_another_model():
    model = _compiled_mixtral("adam")
    capped = hf.Strategy("data", replicas=2, experts=2, capacity_factor=1.25)
    (notice,) = training_notices(model, capped)
    assert "capacity_factor=1.25" in notice and "differs from Keras" in notice
    assert training_notices(model, hf.Strategy("data", replicas=2, experts=2)) == []
    assert training_notices(zoo.compiled("wide_mlp", "adam"), capped) == []  # no mixture


def test_the_model_checks_refuse_what_expert_parallelism_does_not_train_exactly():
    model = _compiled_mixtral("adam")
    two = hf.Strategy("data", replicas=2, experts=2)
    check_expert_parallel(model, two, "mpi")
    check_layout(model, two, "mpi")
    assert len(expert_weights(model)) == 2 * 3  # two blocks, gate, up and down kernels
    refusals = [
        (model, hf.Strategy("data", replicas=8, experts=8), "does not divide the experts"),
        (model, two, "comm='mpi'", "horovod"),
        (zoo.compiled("wide_mlp", "adam"), two, "has none"),
    ]
    for refused, strategy, words, *backend in refusals:
        with pytest.raises(ValueError, match=words):
            check_expert_parallel(refused, strategy, backend[0] if backend else "mpi")
    # clipping and elementwise regularizers sum their shards' parts over the group
    check_expert_parallel(_compiled_mixtral(keras.optimizers.Adam(global_clipnorm=1.0)), two, "mpi")
    check_expert_parallel(_compiled_mixtral(keras.optimizers.SGD(clipnorm=1.0)), two, "mpi")
    expert_weights(model)[0].regularizer = keras.regularizers.L2(0.1)
    check_expert_parallel(model, two, "mpi")
    expert_weights(model)[0].regularizer = keras.regularizers.OrthogonalRegularizer()
    with pytest.raises(ValueError, match=r"expert parallelism \(experts=2\).*not elementwise"):
        check_expert_parallel(model, two, "mpi")


def test_the_memory_plan_counts_a_share_of_the_experts_and_their_slots():
    model = _compiled_mixtral("adam")
    expert_bytes = sum(4 * int(np.prod(v.shape)) for v in expert_weights(model))
    plans = {
        e: hf.memory_plan(model, hf.Strategy("data", replicas=4, experts=e), batch_size=8)
        for e in (1, 2, 4)
    }
    for e in (2, 4):
        assert "experts over" in plans[e].strategy
        for whole, split in zip(plans[1].ranks, plans[e].ranks, strict=True):
            # weights and Adam's two slots: the experts' bytes less 1/E of them, once each
            assert whole.weights - split.weights == expert_bytes - expert_bytes // e
            assert whole.optimizer - split.optimizer == 2 * (expert_bytes - expert_bytes // e)
    # with ZeRO-1 the other variables' slots are sliced over the 4 replicas, the experts' not
    zero = hf.memory_plan(
        model, hf.Strategy("data", replicas=4, experts=2, shard_optimizer=True), batch_size=8
    )
    trainable = sum(4 * int(np.prod(v.shape)) for v in model.trainable_variables)
    for rank in zero.ranks:
        assert rank.optimizer == 2 * (trainable - expert_bytes) // 4 + 2 * expert_bytes // 2

"""The engine's parts built one by one on `MPI.COMM_SELF` (one stage, one replica), each checked
against what Keras computes in the same process: the walk over a runner, the reduction, the
update and the gradient paths (whole and ZeRO-1). The multi-rank behaviour of the same parts is
tested under mpirun (tests/test_engine.py, tests/test_zero.py); these run in seconds."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hyparflow as hf
from hyparflow import _keras
from hyparflow.comm.topology import Topology
from hyparflow.data.batches import GlobalBatch
from hyparflow.engine import events
from hyparflow.engine.gradients.path import (
    BySegmentPath,
    SegmentHooks,
    WholePath,
    build_gradient_path,
)
from hyparflow.engine.gradients.sync import GradientSync
from hyparflow.engine.gradients.update import Update
from hyparflow.engine.sharded_optimizer.sharded_update import ShardedUpdate
from hyparflow.engine.stages.fused import FusedRunner
from hyparflow.engine.stages.walk import Chunk, PipelineWalk

BATCH = 12


def _no_guard(*args, **kwargs):
    return contextlib.nullcontext()


def _model():
    """A small regularized model; SGD with momentum, which has optimizer state (ZeRO-1 splits
    it) but, unlike Adam's first step, does not turn a near-zero gradient's float noise into a
    full step."""
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(7, activation="tanh", kernel_regularizer="l2")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    model.compile(loss="mse", optimizer=optimizer)
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 5)).astype("float32")
    y = rng.normal(size=(BATCH, 2)).astype("float32")
    return x, y


def _parts(model, microbatches=2):
    """The walk, the runner and the reduction of a whole-model stage on COMM_SELF."""
    topology = Topology.create(MPI.COMM_SELF, 1, 1)
    strategy = hf.Strategy("data", microbatches=microbatches).resolve(1)
    variables = list(model.trainable_variables)
    runner = FusedRunner(
        lambda inputs, training: model(inputs, training=training),
        variables,
        loss=_keras.compiled_loss(model),  # the penalties are the update's (as in the trainer)
        microbatches=microbatches,
    )
    walk = PipelineWalk(
        model,
        topology,
        strategy,
        [Chunk(None, runner, True, True)],
        guard=_no_guard,
        span=events.Spans().span,
        loss=None,
        update_metrics=lambda *args: None,
        whole_inputs=True,
    )
    sync = GradientSync(
        topology,
        runner,
        variables,
        list(range(len(variables))),
        [],
        backend="mpi",
        shared=None,
        overlap=None,
    )
    return topology, walk, runner, sync


def _update(model, topology, variables, sync):
    """The stage's `Update` (it owns every variable: one stage)."""
    return Update(
        model,
        topology,
        variables,
        variables,
        partitioned=False,
        guard=_no_guard,
        merge=sync.merge,
    )


def _batch(x, y):
    return GlobalBatch(len(x), lambda start, stop: (x[start:stop], y[start:stop], None))


def _keras_gradients(model, x, y):
    """The gradients of the compiled loss on the whole batch (no weight penalties)."""
    with tf.GradientTape() as tape:
        loss = _keras.compiled_loss(model)(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("microbatches", [1, 2, 3])
def test_the_walk_sums_micro_batches_into_the_whole_batch_gradient(microbatches):
    """A step's walk over `microbatches` pieces, each weighted by its share of the batch, gives
    the gradient of the whole batch's mean loss."""
    model = _model()
    x, y = _data()
    want = _keras_gradients(model, x, y)
    _, walk, runner, sync = _parts(model, microbatches)
    pieces = walk.microbatches(_batch(x, y))
    assert [p.size for p in pieces] == [BATCH // microbatches] * microbatches
    losses = walk.run(pieces, BATCH, train=True)
    assert len(losses) == microbatches and sum(size for _, size in losses) == BATCH
    got = sync.reduce().as_list()  # one replica: the runner's sums, unchanged
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "zero"])
def test_a_gradient_path_steps_the_optimizer_as_keras_does(sharded):
    """`WholePath` (reduce, then `Update.apply`, which adds the L2 penalty's gradient) moves
    every weight as Keras's own `train_on_batch` does; so does ZeRO-1's `ShardedUpdate`, which
    reduces and applies in its place (on one replica its slice is everything)."""
    x, y = _data()
    reference = _model()
    reference.train_on_batch(x, y)
    model = _model()
    topology, walk, _, sync = _parts(model)
    variables = list(model.trainable_variables)
    update = _update(model, topology, variables, sync)
    zero = ShardedUpdate(model, topology, variables, update, sync) if sharded else None
    path = build_gradient_path(
        sync,
        update,
        None,
        zero,
        span=lambda *kind: contextlib.nullcontext(),
        guard=_no_guard,
        step=lambda: 0,
    )
    assert isinstance(path, WholePath)
    assert path.sharded is zero and path.application is (zero or update)
    # no overlap: nothing to call per segment
    assert path.begin(check_numerics=True) == SegmentHooks(None, None)
    penalty = float(sum(model.losses))  # of the weights the step's forward saw
    losses = walk.run(walk.microbatches(_batch(x, y)), BATCH, train=True)
    assert path.finish(losses, check_numerics=True) == pytest.approx(penalty, rel=1e-6)
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


class _SegmentUpdateDouble:
    """What `BySegmentPath` calls of a `SegmentUpdate`, recorded (usable or not, as told)."""

    def __init__(self, usable):
        self._usable, self.calls = usable, []

    def serves(self, check_numerics):
        return self._usable and not check_numerics

    def begin(self):
        self.calls.append("begin")
        return SegmentHooks(last=self.on_segment_done)

    def on_segment_done(self, j):
        self.calls.append(j)

    def finish(self):
        self.calls.append("finish")
        return 0.5


class _WholeDouble:
    def __init__(self):
        self.calls = []

    def begin(self, check_numerics):
        self.calls.append(("begin", check_numerics))
        return SegmentHooks()

    def finish(self, losses, check_numerics):
        self.calls.append(("finish", check_numerics))
        return 1.5


@pytest.mark.parametrize("usable, check_numerics", [(True, False), (True, True), (False, False)])
def test_the_segment_path_serves_the_steps_it_can_and_hands_the_others_to_the_whole(
    usable, check_numerics
):
    segments, whole = _SegmentUpdateDouble(usable), _WholeDouble()
    path = BySegmentPath(segments, whole)
    hooks = path.begin(check_numerics)
    result = path.finish([], check_numerics)
    if usable and not check_numerics:
        assert hooks.last == segments.on_segment_done and result == 0.5
        assert segments.calls == ["begin", "finish"] and whole.calls == []
    else:
        assert hooks == SegmentHooks() and result == 1.5 and segments.calls == []
        assert whole.calls == [("begin", check_numerics), ("finish", check_numerics)]


def test_chunk_runners_sum_a_shared_variable_and_table_over_the_rank_s_chunks():
    """Two chunks of one rank (interleaved) that both read a Dense kernel and an embedding
    table: the rank's gradients are their sums (row slices concatenated), as one stage's
    would be, in list and in flat form."""
    from hyparflow.engine.gradients.flat import FlatLayout
    from hyparflow.engine.stages.chunks import ChunkRunners
    from hyparflow.engine.stages.stage import StageRunner

    keras.utils.set_random_seed(5)
    table, dense = keras.layers.Embedding(10, 3), keras.layers.Dense(3)
    table.build((None,))
    dense.build((None, 3))
    tokens = tf.constant([1, 4, 4], tf.int32)

    def first(inputs, training):  # tokens -> Dense(table)
        return [dense(table(inputs[0]))]

    def second(inputs, training):  # activations -> Dense(activations) + table rows
        return [dense(inputs[0]) + table(tokens)]

    variables = [table.embeddings, dense.kernel, dense.bias]
    runners = [
        StageRunner(first, variables, sparse=[0], input_grads=False),
        StageRunner(second, variables, sparse=[0]),
    ]
    upstream = tf.ones((3, 3))

    def step():  # chunk 0 forward, chunk 1 forward and backward, chunk 0 backward
        runners[1].forward(0, runners[0].forward(0, [tokens]))
        runners[0].backward(0, runners[1].backward(0, [upstream]))

    with tf.GradientTape() as tape:  # the same two chunks as one call
        total = tf.reduce_sum(dense(dense(table(tokens))) + table(tokens))
    expected = tape.gradient(total, [v.value for v in variables])
    for layout in (None, FlatLayout(variables[1:])):  # in list form, then flat
        step()
        chunks = ChunkRunners(runners, variables, sparse=[0], layout=layout)
        if layout is None:
            grads = chunks.take_gradients()
        else:
            flat = chunks.take_flat_gradients()
            grads = [chunks.take_sparse_gradients()[0], *layout.unflatten_fn(flat)]
        assert isinstance(grads[0], tf.IndexedSlices) and grads[0].indices.shape[0] == 6
        for got, want in zip(grads, expected, strict=True):
            np.testing.assert_allclose(
                tf.convert_to_tensor(got), tf.convert_to_tensor(want), rtol=1e-6
            )


def test_shards_clip_as_keras_clips_their_whole_variables():
    """`ShardClipping` on a one-rank group is Keras's `clipnorm` of each variable: a dense
    gradient over the limit, one under it, and a table's row slices; the gradients are of a
    loss scaled by 4 (loss scaling), the norms of the unscaled one."""
    from hyparflow.engine.gradients.shard_clipping import ShardClipping

    variables = [keras.Variable(np.zeros((3, 2), "float32")) for _ in range(3)]
    rng = np.random.default_rng(0)
    over, under = (tf.constant(rng.normal(size=(3, 2)) * s, tf.float32) for s in (12.0, 0.01))
    rows = tf.IndexedSlices(
        tf.constant(rng.normal(size=(2, 2)), tf.float32), tf.constant([0, 2]), tf.constant([3, 2])
    )
    groups = [({id(v) for v in variables}, MPI.COMM_SELF)]
    clipped = ShardClipping(variables, groups, _no_guard).clip([over, under, rows], 1.0, 4.0)
    for got, grad in zip(clipped, [over, under, rows], strict=True):
        values = row_values(grad) / 4.0  # Keras clips the unscaled gradient: g * c / max(|g|, c)
        expected = values * 1.0 / tf.maximum(tf.norm(values), 1.0) * 4.0
        np.testing.assert_allclose(row_values(got), expected, rtol=1e-6)
    assert isinstance(clipped[2], tf.IndexedSlices) and float(tf.norm(over / 4.0)) > 1.0


def row_values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad

"""In-graph collectives count in the `Traffic` record they are handed, and each trainer owns its
`TrafficLog`: nothing is process-wide, so two trainers in one process keep their counts apart."""

import keras
import numpy as np
import tensorflow as tf
from mpi4py import MPI

import hyparflow as hf
from hyparflow.comm import in_graph
from hyparflow.comm.in_graph import allgather, allreduce, collective, exchange
from hyparflow.comm.traffic import Traffic, TrafficLog
from hyparflow.data.batches import GlobalBatch
from hyparflow.engine.custom_step import TAG, CustomStepTrainer, make_trainer
from hyparflow.engine.keras_semantics.global_batch import TAG as GLOBAL_TAG
from tests.support.custom_steps import GuideStep

ROWS = tf.constant(np.arange(6.0).reshape(2, 3), tf.float32)


def test_each_collective_counts_only_in_the_record_it_is_given():
    given, other = TrafficLog(), TrafficLog()
    allreduce(MPI.COMM_SELF, ROWS, given.of("tensor"))
    allgather(MPI.COMM_SELF, ROWS, 0, given.of("tensor"))
    exchange(MPI.COMM_SELF, tf.constant([2], tf.int32), [ROWS], given.of("experts"))
    assert (given.of("tensor").calls, given.of("tensor").bytes) == (2, 2 * ROWS.numpy().nbytes)
    assert (given.of("experts").calls, given.of("experts").bytes) == (1, ROWS.numpy().nbytes)
    assert other.of("tensor") == Traffic() and other.of("experts") == Traffic()
    # the module keeps no records of its own to count into besides
    held = {name: v for name, v in vars(in_graph).items() if not name.startswith("__")}
    assert not [v for v in held.values() if isinstance(v, (dict, Traffic, TrafficLog))]


def test_collectives_in_a_graph_run_in_the_order_they_were_made_by_a_data_edge():
    """Every rank must enter collectives in one order: each collective op takes the previous
    one's output as an input (a control edge was dropped by Grappler; two ranks then ran two
    collectives in different orders and hung). A variable passed in is read in its place."""
    record = TrafficLog().of("tensor")
    variable = tf.Variable(tf.ones([4]))

    @tf.function
    def step(x):
        first = collective(lambda a: a.copy(), [x], tf.float32, [4], record, nbytes=16)
        second = allgather(MPI.COMM_SELF, variable, 0, record)  # independent of `first`
        third = allreduce(MPI.COMM_SELF, x, record)
        return first, second, third

    graph = step.get_concrete_function(tf.TensorSpec([4], tf.float32)).graph
    calls = [op for op in graph.get_operations() if op.type == "PyFunc"]
    assert len(calls) == 3
    for earlier, later in zip(calls, calls[1:], strict=False):
        assert earlier.name in _data_ancestors(later), (earlier.name, later.name)
    first, second, third = step(tf.constant([1.0, 2.0, 3.0, 4.0]))
    assert first.numpy().tolist() == [1.0, 2.0, 3.0, 4.0] and first.shape == [4]  # one rank
    assert second.numpy().tolist() == [1.0] * 4 and third.numpy().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert record.calls == 3


def _data_ancestors(op) -> set:
    """The names of the ops `op` reads through data edges, directly or not."""
    found, todo = set(), [t.op for t in op.inputs]
    while todo:
        current = todo.pop()
        if current.name not in found:
            found.add(current.name)
            todo.extend(t.op for t in current.inputs)
    return found


def test_a_listener_hears_the_calls_of_its_tags_until_cleared():
    log, heard = TrafficLog(), []
    log.listen(["tensor"], lambda start, end, nbytes: heard.append(nbytes))
    allreduce(MPI.COMM_SELF, ROWS, log.of("tensor"))
    allreduce(MPI.COMM_SELF, ROWS, log.of("batchnorm"))
    log.listen(["tensor"], None)
    allreduce(MPI.COMM_SELF, ROWS, log.of("tensor"))
    assert heard == [ROWS.numpy().nbytes]
    assert log.of("tensor").calls == 2


def _guide_step_model():
    inputs = keras.Input((3,))
    model = GuideStep(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_two_trainers_in_one_process_count_their_own_traffic():
    """A model's own train_step sums its gradients with an in-graph allreduce (over one rank
    here): only the trainer that ran it counts it."""
    strategy = hf.Strategy("data").resolve(1)
    first, second = (make_trainer(_guide_step_model(), strategy, MPI.COMM_SELF) for _ in "ab")
    assert isinstance(first, CustomStepTrainer) and first.traffic is not second.traffic
    # the parts that issue collectives hold the records of their own trainer's log
    assert first.sharded_layers.batch.traffic is first.traffic.of(GLOBAL_TAG)
    assert first.sharded_layers.dispatch.traffic is first.traffic
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    first.optimizer_step(GlobalBatch(4, lambda start, stop: (x[start:stop], y[start:stop], None)))
    assert first.traffic.of(TAG).calls == 1
    assert second.traffic.of(TAG) == Traffic()

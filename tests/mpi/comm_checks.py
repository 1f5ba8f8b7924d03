"""Four ranks as 2 partitions x 2 replicas: topology, pipeline p2p and fused gradient reduction.

Each rank checks what it can see and reports facts (lists, counts, max errors) for
tests/test_comm.py to assert on. Any exception aborts the whole job so no rank hangs.
"""

import time

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from hyparflow.comm import failure, hugepages
from hyparflow.comm.agree import all_failed, failure_comm
from hyparflow.comm.allreduce import GradientReducer
from hyparflow.comm.p2p import BACKWARD, FORWARD, PipeChannel
from hyparflow.comm.topology import Topology
from hyparflow.engine.gradients.flat import FlatLayout
from hyparflow.launch.malloc import keep_temporaries_in_heap
from tests.support.report import report, run_or_abort
from tests.support.tensors import address, same

MAX_BATCH = 4
SIZES = [MAX_BATCH, MAX_BATCH, 2]  # the last micro-batch of the "epoch" is smaller
FORWARD_SPECS = [
    ((MAX_BATCH, 3), "float32"),
    ((MAX_BATCH, 2, 2), "bfloat16"),
    ((MAX_BATCH,), "int32"),
    ((MAX_BATCH, 5), "float16"),
]
BACKWARD_SPECS = [FORWARD_SPECS[0], FORWARD_SPECS[3]]  # only float tensors have gradients


def payload(specs, microbatch, direction, replica, batch):
    """Distinct, exactly representable values for every (micro-batch, tensor, direction, pipe)."""
    tensors = []
    for index, (shape, dtype) in enumerate(specs):
        shape = (batch, *shape[1:])
        base = 1000 * replica + 100 * microbatch + 10 * index + (5 if direction == BACKWARD else 0)
        values = base % 2000 + np.arange(np.prod(shape)) % 7
        tensors.append(tf.constant(values.reshape(shape), dtype=dtype))
    return tensors


def check_topology(topo):
    grid = topo.grid
    return {
        "stage": topo.stage,
        "replica": topo.replica,
        "pipeline_members": topo.pipeline_comm.allgather(topo.rank),
        "expected_pipeline": grid.pipeline_ranks(topo.replica),
        "stage_members": topo.stage_comm.allgather(topo.rank),
        "expected_stage": grid.stage_ranks(topo.stage),
        "pipeline_rank": topo.pipeline_comm.Get_rank(),
        "stage_comm_rank": topo.stage_comm.Get_rank(),
        "prev_next": [topo.prev_rank, topo.next_rank],
        "sizes": [topo.num_stages, topo.num_replicas],
    }


def check_pipeline(topo, transport):
    """Out-of-order sends, differently ordered receives, a small last batch, zero copy, reuse."""
    check = _PipelineCheck(topo, transport)
    for step in range(2):  # the second step must reuse every buffer
        check.out_of_order_step(step)
    check.out["allocations_after_step1"] = check.channel.allocations
    check.held_tensors()
    check.both_directions()
    check.wrong_batch_size()
    check.channel.close()
    check.twin.close()
    return check.out


class _PipelineCheck:
    """One rank's side of `check_pipeline`: its channel to the other stage and its facts."""

    def __init__(self, topo, transport):
        self.topo, self.transport = topo, transport
        self.first = topo.is_first_stage
        self.peer = topo.next_rank if self.first else topo.prev_rank
        self.pipe = topo.replica  # values carry the pipeline, so crossed pipelines would show
        self.channel = PipeChannel(
            topo.pipeline_comm,
            self.peer,
            FORWARD_SPECS,
            len(SIZES),
            backward_specs=BACKWARD_SPECS,
            transport=transport,
        )
        self.twin = None
        self.out = {"values_ok": [], "zero_copy": [], "mutation_visible": []}

    def expect(self, mb, direction):
        """The payload the other stage sends for micro-batch `mb` in `direction`."""
        specs = FORWARD_SPECS if direction == FORWARD else BACKWARD_SPECS
        return payload(specs, mb, direction, self.pipe, SIZES[mb])

    def receive(self, mb, direction, **kw):
        """Receive, noting whether the values are right and the tensors are the buffers."""
        got = self.channel.recv(mb, direction, **kw)
        self.out["values_ok"].append(same(got, self.expect(mb, direction)))
        buffers = [self.channel.receive_buffer(mb, direction, i) for i in range(len(got))]
        shares = all(address(t) == address(b) for t, b in zip(got, buffers, strict=True))
        self.out["zero_copy"].append([SIZES[mb], shares])
        return got, buffers

    def out_of_order_step(self, step):
        """Micro-batches sent and received in different orders, the last one smaller."""
        channel, out = self.channel, self.out
        if self.first:
            handles = [channel.isend(self.expect(mb, FORWARD), mb, FORWARD) for mb in (2, 0, 1)]
            for mb in (2, 1, 0):
                self.receive(mb, BACKWARD)
            for handle in handles:
                handle.wait()
        else:
            kept = {}
            for mb in (1, 2, 0):
                kept[mb], buffers = self.receive(mb, FORWARD, batch_size=SIZES[mb])
                if self.transport == "host" and step == 0:
                    buffers[0].reshape(-1)[0] = -1.0  # writes to the buffer show in the tensor
                    out["mutation_visible"].append(float(kept[mb][0][0, 0]) == -1.0)
            out["small_batch_shape"] = [list(t.shape) for t in kept[2]]
            del kept
            for mb in (0, 2, 1):
                channel.isend(self.expect(mb, BACKWARD), mb, BACKWARD)
            channel.wait_sends()
        if step == 0:
            out["allocations_after_step0"] = channel.allocations

    def held_tensors(self):
        """Held tensors are never overwritten: the slot gets fresh buffers instead."""
        channel, out = self.channel, self.out
        if self.first:
            channel.isend(self.expect(0, FORWARD), 0, FORWARD).wait()
            channel.isend(payload(FORWARD_SPECS, 0, FORWARD, 7, MAX_BATCH), 0, FORWARD).wait()
            return
        held = channel.recv(0, FORWARD)
        before = channel.allocations
        again = channel.recv(0, FORWARD)
        out["held_intact"] = same(held, self.expect(0, FORWARD)) and same(
            again, payload(FORWARD_SPECS, 0, FORWARD, 7, MAX_BATCH)
        )
        out["held_reallocated"] = channel.allocations - before
        out["held_distinct"] = address(held[0]) != address(again[0])

    def both_directions(self):
        """Both directions at once between the same two ranks, same sizes: only the tag's
        direction bit keeps them apart."""
        topo = self.topo
        self.twin = twin = PipeChannel(
            topo.pipeline_comm, self.peer, BACKWARD_SPECS, 1, transport=self.transport
        )
        mine, theirs = topo.stage, 1 - topo.stage
        sends = [
            twin.isend(payload(BACKWARD_SPECS, 0, d, 10 * mine, MAX_BATCH), 0, d)
            for d in (FORWARD, BACKWARD)
        ]
        self.out["directions_ok"] = [
            same(twin.recv(0, d), payload(BACKWARD_SPECS, 0, d, 10 * theirs, MAX_BATCH))
            for d in (BACKWARD, FORWARD)
        ]
        for handle in sends:
            handle.wait()

    def wrong_batch_size(self):
        """A receiver expecting another batch size says so."""
        if self.first:
            self.channel.isend(self.expect(2, FORWARD), 2, FORWARD).wait()
            return
        try:
            self.channel.recv(2, FORWARD, batch_size=MAX_BATCH)
            self.out["wrong_batch_error"] = ""
        except RuntimeError as error:
            self.out["wrong_batch_error"] = str(error)


def gradients(seed, float_dtypes=("float32", "float64")):
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (7,), (2, 2, 2), (1,), (5, 3), (4,), (6, 1)]
    return [
        rng.standard_normal(shape).astype(float_dtypes[i % len(float_dtypes)])
        for i, shape in enumerate(shapes)
    ]


def max_error(results, expected):
    return max(
        float(np.max(np.abs(np.asarray(r) - e))) for r, e in zip(results, expected, strict=True)
    )


def stage_mean(seed, members, float_dtypes=("float32", "float64")):
    """The mean over `members` of each rank's `gradients(seed + rank)`."""
    every = [gradients(seed + r, float_dtypes) for r in members]
    return [sum(arrays) / len(members) for arrays in zip(*every, strict=True)]


def check_allreduce(topo):
    """Fused gradient reduction: buckets, held results, a background thread, TF tensors, a
    nonblocking start, the flat data-parallel path and a single rank."""
    comm = topo.stage_comm
    members = comm.allgather(topo.rank)
    out = check_small_buckets(comm, topo.rank, members)
    out.update(check_background_reduction(topo, members))
    out.update(check_world_sum(topo))
    out.update(check_nonblocking_start(comm, topo.rank, members))
    out.update(check_flat_reduction(comm, topo.rank, members))
    # One rank: nothing to do, inputs come back as they are.
    single = GradientReducer(MPI.COMM_SELF)
    grads = gradients(0)
    out["single_rank_identity"] = all(
        r is g for r, g in zip(single.reduce(grads), grads, strict=True)
    )
    out["single_rank_calls"] = single.mpi_calls
    return out


def check_small_buckets(comm, rank, members):
    """Numpy inputs, many small buckets, mean over the stage's replicas, two steps; then
    results still held, whose buckets are reallocated rather than overwritten."""
    out = {}
    reducer = GradientReducer(comm, bucket_bytes=128)
    for step in range(2):
        grads = gradients(100 * step + rank)
        mean = stage_mean(100 * step, members)
        results = reducer.reduce(grads)
        out[f"small_buckets_error_{step}"] = max_error(results, mean)
        out[f"small_buckets_dtypes_{step}"] = [str(r.dtype) for r in results] == [
            str(g.dtype) for g in grads
        ]
        out[f"small_buckets_shapes_{step}"] = [r.shape for r in results] == [g.shape for g in grads]
        del results
    out["small_buckets"] = [reducer.num_buckets, reducer.mpi_calls, len(grads)]
    out["small_buckets_allocations"] = reducer.allocations
    held = reducer.reduce(gradients(300 + rank))
    reducer.reduce(gradients(400 + rank))
    out["held_error"] = max_error(held, stage_mean(300, members))
    out["held_reallocated"] = reducer.allocations - reducer.num_buckets
    return out


def check_background_reduction(topo, members):
    """The same reduction on a background thread, two steps, while this thread keeps using MPI."""
    specs = [(g.shape, g.dtype) for g in gradients(0)]
    threaded = GradientReducer(topo.stage_comm, specs, bucket_bytes=128, background=True)
    errors = []
    for step in range(2):
        mean = stage_mean(500 + step, members)
        for index, grad in enumerate(gradients(500 + step + topo.rank)):
            threaded.start(index, grad)
        topo.world.Barrier()  # main-thread MPI traffic while buckets reduce (THREAD_MULTIPLE)
        errors.append(max_error(threaded.finish(), mean))
    threaded.close()
    return {
        "background_error": max(errors),
        "background_calls": [threaded.num_buckets, threaded.mpi_calls],
    }


def check_world_sum(topo):
    """TF tensors over the whole world, default buckets: one call per dtype, sum."""
    world = topo.world
    reducer = GradientReducer(world, op="sum")
    grads = [tf.constant(g) for g in gradients(topo.rank)]
    total = [
        sum(arrays) for arrays in zip(*[gradients(r) for r in range(world.Get_size())], strict=True)
    ]
    results = reducer.reduce(grads)
    return {
        "world_sum_error": max_error(results, total),
        "world_sum_tensors": all(tf.is_tensor(r) for r in results),
        "world_views_bucket": all(
            any(np.shares_memory(r._numpy(), bucket) for bucket in reducer._buffers)
            for r in results
        ),
        "world_calls": [reducer.num_buckets, reducer.mpi_calls],
    }


def check_nonblocking_start(comm, rank, members):
    """Nonblocking start in reverse order with a None gradient and half precision; finishing
    before every gradient has started is an error."""
    specs = [((3,), "float16"), ((2, 2), "bfloat16"), ((4,), "float32"), ((2,), "float32")]
    reducer = GradientReducer(comm, specs, bucket_bytes=1)  # every gradient its own bucket
    local = [tf.constant(np.arange(3) + rank, tf.float16), tf.ones((2, 2), tf.bfloat16)]
    local += [None, tf.constant([rank, 1.0])]
    calls = []
    for index in reversed(range(len(specs))):
        reducer.start(index, local[index])
        calls.append(reducer.mpi_calls)  # a full bucket starts right away
    results = reducer.finish()
    replicas = np.array(members, dtype=np.float64)
    out = {
        "async_calls": calls,
        "async_none": results[2] is None,
        "async_dtypes": [r.dtype.name for r in results if r is not None],
        "async_error": max(
            float(
                np.max(
                    np.abs(np.asarray(results[0], np.float64) - (np.arange(3) + replicas.mean()))
                )
            ),
            float(np.max(np.abs(np.asarray(results[1], np.float64) - 1.0))),
            float(np.max(np.abs(np.asarray(results[3]) - [replicas.mean(), 1.0]))),
        ),
    }
    try:
        incomplete = GradientReducer(comm, specs)  # one bucket: start(0) alone launches nothing
        incomplete.start(0, local[0])
        incomplete.finish()
        out["finish_missing_error"] = ""
    except RuntimeError as error:
        out["finish_missing_error"] = str(error)
    return out


def check_flat_reduction(comm, rank, members):
    """The data-parallel path: one flat tensor built by a compiled function (its tail holds a
    data-dependent scalar), reduced in place in 64-byte slices; views come back."""
    out = {}
    specs = [tf.TensorSpec(g.shape) for g in gradients(0, ("float32",))]
    layout = FlatLayout(specs)
    pack = tf.function(layout.flatten)
    flat_reducer = GradientReducer(comm, op="sum", bucket_bytes=64)
    errors, same = [], []
    for step in range(2):
        local = [tf.constant(g) for g in gradients(700 + step + rank, ("float32",))]
        flat = pack(local, tf.constant(float(rank)))
        reduced = flat_reducer.reduce_flat(flat)
        same.append(reduced is flat)
        every = [gradients(700 + step + r, ("float32",)) for r in members]
        total = [sum(arrays) for arrays in zip(*every, strict=True)]
        errors.append(max_error(layout.unflatten_fn(reduced), total))
        tail = reduced.numpy()[layout.tail_offset :]
        out[f"flat_tail_{step}"] = bool(np.all(tail == float(sum(members))))
    out["flat_error"] = max(errors)
    out["flat_in_place"] = all(same)
    out["flat_calls"] = [flat_reducer.mpi_calls, -(-layout.length // 16)]
    mean_reducer = GradientReducer(comm, op="mean")
    mean = mean_reducer.reduce_flat(
        pack([tf.constant(g) for g in gradients(0, ("float32",))], tf.constant(float(rank)))
    )
    out["flat_mean_tail"] = float(mean.numpy()[-1]) * len(members) == float(sum(members))
    return out


def check_huge_pages(topo):
    """A 6 MiB activation and its gradient: exact values, promoted pages, huge receive buffers,
    with promotion opted in to as hf.Strategy(tune_process=True) does."""
    first = topo.is_first_stage
    peer = topo.next_rank if first else topo.prev_rank
    shape = (6 * 256, 1024)  # 6 MiB of float32
    channel = PipeChannel(topo.pipeline_comm, peer, [(shape, "float32")], 1)
    worker = hugepages.start_promoting(keep_temporaries_in_heap())
    out = {"enabled": worker.enabled, "reason": worker.reason, "values_ok": [], "collapsed": []}
    base = tf.reshape(tf.range(np.prod(shape), dtype=tf.float32), shape)
    for step in range(3):
        value = base * float(step + 1 + topo.replica)  # a fresh TF tensor each step
        if first:
            channel.isend([value], 0, FORWARD).wait()
            (got,) = channel.recv(0, BACKWARD)
        else:
            (got,) = channel.recv(0, FORWARD)
            channel.isend([got * 2.0], 0, BACKWARD).wait()
        expected = value * 2.0 if first else value
        out["values_ok"].append(bool(tf.reduce_all(got == expected)))
        out["collapsed"].append(worker.collapsed)
        del got
    direction = BACKWARD if first else FORWARD
    out["buffer_alignment"] = address(channel.receive_buffer(0, direction, 0)) % (2 * 2**20)
    channel.close()
    return out


def check_failure_channel(world):
    """Rank 3 announces a failure while the others are blocked: rank 0 in a receive nobody
    sends, ranks 1 and 2 in collectives rank 3 never enters. Each leaves with `PeerFailed`."""
    rank = world.Get_rank()
    scratch = failure.watched(world.Dup())  # its barrier stays unmatched afterwards
    channel = failure.FailureChannel(world)
    out = {}
    with failure.watching(channel):
        try:
            if rank == 3:
                time.sleep(0.5)  # the others are waiting by now
                channel.announce(RuntimeError("disk full\nsecond line"))
                out["left"] = "announced"
            elif rank == 0:
                request = scratch.Irecv(np.zeros(1), source=1, tag=99)
                failure.wait_all([request])
            else:
                scratch.allreduce(1) if rank == 1 else scratch.Barrier()
        except failure.PeerFailed as error:
            out["left"] = str(error)
    if rank == 0:
        request.Cancel()
        request.Wait()
    out["all_failed"] = all_failed(failure_comm(world), None, timeout=60)
    return out


def main():
    world = MPI.COMM_WORLD
    topo = Topology.create(world, partitions=2, replicas=2)
    result = {"rank": topo.rank, "topology": check_topology(topo)}
    result["p2p_host"] = check_pipeline(topo, "host")
    result["p2p_device"] = check_pipeline(topo, "device")  # the GPU code path, on CPU tensors
    result["allreduce"] = check_allreduce(topo)
    result["huge_pages"] = check_huge_pages(topo)
    result["failure"] = check_failure_channel(world)
    try:
        Topology.create(world, partitions=3, replicas=1)
        result["bad_grid_error"] = ""
    except ValueError as error:
        result["bad_grid_error"] = str(error)
    topo.free()
    report(result)


if __name__ == "__main__":
    run_or_abort(main)

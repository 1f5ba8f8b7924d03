"""Two ranks: boundary tensors with an unknown sequence length through one `PipeChannel`.

Rank 0 sends activations and receives gradients, rank 1 the reverse. Over five steps the
sequence length changes (LENGTHS); each step has micro-batches of 4, 4 and 2 samples. Receives
alternate between `irecv` posted up front (before the sender sends) and blocking `recv`, in
both directions. Each rank reports, for the direction it receives: exact values and shapes,
zero copy, buffer reuse and growth, and that tensors held across a step stay intact; then a
wrong batch size, and that a static-only channel leaves no message behind. Both transports run
("device" forces the GPU code path on CPU tensors). tests/test_comm.py asserts on the reports.
"""

import math
import time

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from hyparflow.comm.p2p import BACKWARD, DIRECTIONS, FORWARD, PipeChannel
from tests.support.report import report, run_or_abort
from tests.support.tensors import address, same

MAX_BATCH = 4
SIZES = [MAX_BATCH, MAX_BATCH, 2]  # the last micro-batch is smaller
LENGTHS = [7, 3, 12, 12, 1]  # shrink, grow, repeat, shrink
FORWARD_SPECS = [
    ((MAX_BATCH, None, 3), "float32"),  # hidden states
    ((MAX_BATCH, None), "int32"),  # a padding mask
    ((MAX_BATCH, 5), "float32"),  # static
]
BACKWARD_SPECS = [FORWARD_SPECS[0], FORWARD_SPECS[2]]  # only float tensors have gradients
SPECS = {FORWARD: FORWARD_SPECS, BACKWARD: BACKWARD_SPECS}
HOLD = (1, 2)  # micro-batch 0 received in these steps is kept through the next step


def payload(direction, step, microbatch, length, batch=None):
    """Distinct, exactly representable values for every (step, micro-batch, tensor, direction)."""
    tensors = []
    for index, (shape, dtype) in enumerate(SPECS[direction]):
        batch = SIZES[microbatch] if batch is None else batch
        shape = (batch, *(length if d is None else d for d in shape[1:]))
        base = 1000 * step + 100 * microbatch + 10 * index + (5 if direction == BACKWARD else 0)
        values = base + np.arange(math.prod(shape)) % 7
        tensors.append(tf.constant(values.reshape(shape), dtype))
    return tensors


def nothing_pending(comm, peer) -> bool:
    """Whether no message from `peer` waits unreceived on `comm` (after both reach a barrier)."""
    comm.Barrier()
    for _ in range(20):  # give a message still in flight time to show up
        if comm.Iprobe(source=peer, tag=MPI.ANY_TAG):
            return False
        time.sleep(0.005)
    return True


def check_dynamic(transport):
    """Five steps of changing sequence lengths, a wrong batch size, a static-only channel."""
    comm = MPI.COMM_WORLD.Dup()  # its own tag space: nothing from other checks can match
    rank = comm.Get_rank()
    peer = 1 - rank
    channel = PipeChannel(
        comm,
        peer,
        FORWARD_SPECS,
        len(SIZES),
        backward_specs=BACKWARD_SPECS,
        transport=transport,
    )
    out = {"values_ok": [], "shapes": [], "zero_copy": [], "allocations": [], "capacity": []}
    out.update(reused=[], held_intact=[], modes=[])
    exchange_steps(channel, comm, BACKWARD if rank == 0 else FORWARD, out)
    check_wrong_batch(channel, rank, out)
    out["dynamic_nothing_pending"] = nothing_pending(comm, peer)
    channel.close()
    check_static_only(comm, peer, transport, out)
    comm.Free()
    return out


def exchange_steps(channel, comm, receives, out):
    """Every step of LENGTHS in both directions; facts on the direction this rank `receives`."""
    held, previous = None, None
    for step, length in enumerate(LENGTHS):
        for direction in DIRECTIONS:
            upfront = (step + DIRECTIONS.index(direction)) % 2 == 0
            if direction != receives:
                if upfront:
                    comm.Barrier()  # the receiver has posted every receive of the step
                for mb in (1, 2, 0):
                    channel.isend(payload(direction, step, mb, length), mb, direction)
                channel.wait_sends()
                continue
            out["modes"].append("irecv" if upfront else "recv")
            got, buffers = receive_step(channel, comm, direction, upfront)
            record_step(out, channel, got, buffers, direction, step, length)
            if previous is not None:  # the same buffer objects as last step, per slot and tensor
                out["reused"].append(
                    [
                        [b is p for b, p in zip(bufs, prev, strict=True)]
                        for bufs, prev in zip(buffers, previous, strict=True)
                    ]
                )
            previous = buffers
            if held is not None:  # received a step ago into slot 0, kept through this one
                out["held_intact"].append(
                    same(held, payload(direction, step - 1, 0, LENGTHS[step - 1]))
                )
            held = got[0] if step in HOLD else None
            del got, buffers


def receive_step(channel, comm, direction, upfront):
    """One step's micro-batches, out of order, by `irecv` posted up front or by `recv`; and
    each slot's receive buffers."""
    if upfront:
        handles = [channel.irecv(mb, direction) for mb in range(len(SIZES))]
        comm.Barrier()
        got = {mb: handles[mb].wait(batch_size=SIZES[mb]) for mb in (2, 0, 1)}
    else:
        got = {mb: channel.recv(mb, direction) for mb in (2, 0, 1)}
    got = [got[mb] for mb in range(len(SIZES))]
    buffers = [
        [channel.receive_buffer(mb, direction, i) for i in range(len(SPECS[direction]))]
        for mb in range(len(SIZES))
    ]
    return got, buffers


def record_step(out, channel, got, buffers, direction, step, length):
    """A received step's values, shapes, zero copy and buffer sizes."""
    out["values_ok"].append(
        [same(got[mb], payload(direction, step, mb, length)) for mb in range(len(SIZES))]
    )
    out["shapes"].append([[list(t.shape) for t in tensors] for tensors in got])
    out["zero_copy"].append(
        all(
            address(t) == address(b)
            for tensors, bufs in zip(got, buffers, strict=True)
            for t, b in zip(tensors, bufs, strict=True)
        )
    )
    out["allocations"].append(channel.allocations)
    out["capacity"].append([math.prod(bufs[0].shape) for bufs in buffers])


def check_wrong_batch(channel, rank, out):
    """A receiver expecting another batch size says so; the data is still drained, so the
    next message of the same tag arrives intact."""
    if rank == 0:
        channel.isend(payload(FORWARD, 5, 2, 5), 2, FORWARD).wait()
        channel.isend(payload(FORWARD, 6, 2, 6), 2, FORWARD).wait()
        return
    try:
        channel.recv(2, FORWARD, batch_size=MAX_BATCH)
        out["wrong_batch_error"] = ""
    except RuntimeError as error:
        out["wrong_batch_error"] = str(error)
    out["after_error_ok"] = same(channel.recv(2, FORWARD, batch_size=2), payload(FORWARD, 6, 2, 6))


def check_static_only(comm, peer, transport, out):
    """A static-only channel sends no shape header: nothing is left unreceived."""
    static = PipeChannel(comm, peer, [FORWARD_SPECS[2]], 1, transport=transport)
    if comm.Get_rank() == 0:
        static.isend(payload(FORWARD, 7, 2, 0)[2:], 0, FORWARD).wait()
    else:
        (got,) = static.recv(0, FORWARD)
        out["static_ok"] = same([got], payload(FORWARD, 7, 2, 0)[2:])
        out["static_allocations"] = static.allocations
        del got
    out["static_nothing_pending"] = nothing_pending(comm, peer)
    static.close()


def main():
    result = {"rank": MPI.COMM_WORLD.Get_rank()}
    for transport in ("host", "device"):
        result[transport] = check_dynamic(transport)
    report(result)


if __name__ == "__main__":
    run_or_abort(main)

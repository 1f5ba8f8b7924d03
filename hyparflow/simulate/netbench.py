"""Measure this machine's `Network`: mpi4py ping-pong and allreduce, and hyparflow's own costs.

Run under MPI with two ranks (`launch()` does it: `mpirun -np 2 python -m
hyparflow.simulate.netbench OUT.json`); rank 0 writes the JSON that `Network.from_dict` reads.

- latency and bandwidth: ping-pong of numpy buffers from 8 B to 16 MiB; the one-way time of
  the smallest message is the latency, a line through the large ones gives the bandwidth.
- reduce rate: in-place `Allreduce` from 64 KiB to 16 MiB, less what the links explain.
- per-tensor cost and copy rate: hyparflow's `GradientReducer` (and the trainer's conversion
  of its results) on 1 MiB in 4 and in 64 gradients, and on 16 MiB in 16, less one raw
  allreduce of the same bytes.
- engine overhead and handoff: tiny two-stage pipelines (4 KiB and 512 KiB per micro-batch
  between the stages) trained with `hf.fit` and the engine's span recorder: the sender's time
  posting each message, and the time from there to the waiting receiver holding the tensors,
  as a fixed handoff plus the bytes at an effective bandwidth.
- the training loop's work per step on each rank: from one step's start to the next, less
  every recorded span (compute, sends, receives, reduction, optimizer), on the first and last
  stage of those pipelines and on the ranks of the same model trained data parallel.

Latency and bandwidth are the fastest of 30 repetitions (what the link can do); the
reductions and the engine's costs are medians, like the step times they add up to. With
`--oversubscribed CORES` (more ranks than cores: `launch()` starts twice as many ranks as
cores when there are at most 8), CORES ranks compute while the others ping-pong in pairs (the
median one-way time less the latency is a pipeline message's scheduling wait on an
oversubscribed node), again computing without an MPI call for 50 ms at a time, as inside a
TensorFlow call (the mean one-way time less the latency is how long a woken rank waits for
the core: `oversubscribed_wakeup`), then compute while the others sleep and while they wait
in MPI (how much of a core a waiting rank still takes: the idle share), and all ranks reduce
1, 4 and 16 MiB with hyparflow's reducer (what exceeds the model, per step of the allreduce,
is a collective step's wait).

The ranks share a node, so this measures the intra-node link only; give the inter-node one
from the network's specification (or run this with one rank on each of two nodes and use its
intra figures as the inter link).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

WAKEUP_CHUNK_S = 0.05  # a computing rank's work between MPI calls in `oversubscribed_wakeup`
PINGPONG_SIZES = [8, 1024, 16 * 1024, 256 * 1024, 1 << 20, 4 << 20, 16 << 20]
ALLREDUCE_SIZES = [64 * 1024, 1 << 20, 4 << 20, 16 << 20]
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
}


def launch(out_path: str, python: str = sys.executable, timeout: float = 600) -> dict:
    """Run this benchmark on two local ranks with `mpirun` (and, on a machine of at most 8
    cores, once more oversubscribed); returns the network dict."""
    _mpirun(2, [out_path], python, timeout)
    with open(out_path) as f:
        network = json.load(f)
    cores = os.cpu_count() or 1
    if cores <= 8:
        extra = out_path + ".oversubscribed"
        ranks = max(2 * cores, cores + 2)  # a pair to ping-pong beside every core's rank
        _mpirun(ranks, [extra, "--oversubscribed", str(cores)], python, timeout)
        with open(extra) as f:
            crowded = json.load(f)
        latency = network["intra"]["latency"]
        network["oversubscribed_latency"] = max(0.0, crowded["one_way_s"] - latency)
        reducer = {int(n): t for n, t in crowded["reducer_s"].items()}
        network["oversubscribed_collective_latency"] = collective_wait(
            network, reducer, ranks, cores
        )
        network["oversubscribed_idle_share"] = crowded["idle_share"]
        network["oversubscribed_wakeup"] = max(0.0, crowded["wakeup_one_way_s"] - latency)
        network["source"]["oversubscribed_one_way_s"] = crowded["one_way_s"]
        network["source"]["oversubscribed_wakeup_one_way_s"] = crowded["wakeup_one_way_s"]
        network["source"]["oversubscribed_reducer_s"] = crowded["reducer_s"]
        network["source"]["oversubscribed_ranks"] = ranks
        with open(out_path, "w") as f:
            json.dump(network, f, indent=1)
    return network


def collective_wait(network: dict, reducer: dict, ranks: int, cores: int) -> float:
    """Seconds each step of an allreduce waits for the scheduler on an oversubscribed node:
    the measured reduction (`reducer`: seconds by bytes, 16 gradients, all `ranks`) less what
    the model says without that wait, per step of the algorithm it picks (ranks busy copying
    and adding do not yield their core, so a step waits for a time slice, not a yield)."""
    from hyparflow.simulate.network import Network, allreduce, latency_steps

    model = Network.from_dict({**network, "oversubscribed_collective_latency": 0.0})
    slow = ranks / cores
    waits = []
    for nbytes, seconds in reducer.items():
        predicted = model.gradient_allreduce(nbytes, ranks, False, 1, slow, tensors=16)
        link = model.intra
        _, name = allreduce(nbytes, ranks, type(link)(link.latency * slow, link.bandwidth / slow))
        waits.append((seconds - predicted) / latency_steps(name, ranks))
    return max(0.0, statistics.median(waits))


def _mpirun(ranks: int, args: list[str], python: str, timeout: float) -> None:
    command = ["mpirun", "-np", str(ranks), "--bind-to", "none", python, "-m", __name__, *args]
    result = subprocess.run(
        command, env={**os.environ, **MPI_ENV}, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"network benchmark failed ({' '.join(command)}):\n{result.stderr[-3000:]}"
        )


def one_way(comm, nbytes: int, repeats: int) -> float:
    """Fastest one-way time of a raw mpi4py ping-pong of `nbytes` between ranks 0 and 1."""
    buffer = np.zeros(max(1, nbytes), dtype=np.uint8)
    peer = 1 - comm.Get_rank()
    samples = []
    for i in range(repeats + 2):
        comm.Barrier()
        start = time.perf_counter()
        if comm.Get_rank() == 0:
            comm.Send(buffer, dest=peer, tag=7)
            comm.Recv(buffer, source=peer, tag=7)
        else:
            comm.Recv(buffer, source=peer, tag=7)
            comm.Send(buffer, dest=peer, tag=7)
        if i >= 2:  # the first rounds set up the connection and buffers
            samples.append((time.perf_counter() - start) / 2)
    return min(samples)


def allreduce_time(comm, nbytes: int, repeats: int) -> float:
    """Median time of one in-place float32 `Allreduce` of `nbytes` (slowest rank's)."""
    from mpi4py import MPI

    buffer = np.ones(nbytes // 4, dtype=np.float32)
    samples = []
    for i in range(repeats + 2):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buffer)
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= 2:
            samples.append(elapsed)
    return statistics.median(samples)


def engine_hops(comm, steps: int = 12, widths=(64, 8192)) -> dict:
    """Tiny two-stage pipelines (a Dense layer of `width` units, then the head) trained with
    `hf.fit`, their spans recorded on both ranks: per boundary size, the sender's seconds per
    message posted and, when the receiver was already waiting, the seconds from the post to
    the receiver holding the tensors, and each stage's loop work per step (`loop_work`).
    Rank 0 gets {bytes: {"send_s": [...], "handoff_s": [...], "loop_first_s": [...],
    "loop_last_s": [...]}}."""
    strategy = {"kind": "model", "microbatches": 4, "schedule": "1f1b", "balance": ["head"]}
    results = {}
    for width in widths:
        steps_by_rank = _recorded_fit(comm, width, strategy, steps)
        if comm.Get_rank() == 0:
            first, last = (loop_work(records) for records in steps_by_rank)
            results[16 * width * 4] = {
                **_hops(steps_by_rank), "loop_first_s": first, "loop_last_s": last,
            }  # fmt: skip
    return results


def unpartitioned_loop_work(comm, steps: int = 12) -> list | None:
    """The same tiny model trained data parallel on both ranks: every rank's loop work per
    step (`loop_work`), on rank 0."""
    steps_by_rank = _recorded_fit(comm, 64, {"kind": "data"}, steps)
    if comm.Get_rank() != 0:
        return None
    return [seconds for records in steps_by_rank for seconds in loop_work(records)]


def _recorded_fit(comm, width: int, strategy: dict, steps: int) -> list | None:
    """Train a Dense layer of `width` units and a head with `hf.fit` (2 epochs of `steps`
    steps of 64 samples) under `strategy`, recording every rank's steps; rank 0 gets them
    by rank."""
    import keras

    import hyparflow as hf
    from hyparflow.engine import events

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * steps, 64)).astype("float32")
    y = rng.integers(0, 8, size=64 * steps)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    wide = keras.layers.Dense(width, activation="relu", name="wide")(inputs)
    outputs = keras.layers.Dense(8, activation="softmax", name="head")(wide)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    recorder = events.Recorder()

    class Record(keras.callbacks.Callback):
        def attach_trainer(self, trainer, recorder=recorder):
            self.trainer = trainer
            trainer.attach_recorder(recorder)

        def on_train_end(self, logs=None):
            self.trainer.attach_recorder(None)

    hf.fit(model, x, y, batch_size=64, epochs=2, verbose=0,
           strategy=hf.Strategy(**strategy), callbacks=[Record()])  # fmt: skip
    return comm.gather(recorder.take(), root=0)


def loop_work(records, skip: int = 2) -> list[float]:
    """Seconds per step a rank spent outside its recorded spans (compute, sends, receives,
    reduction, optimizer): from one step's start to the next, less the spans. That is the
    training loop's own work between steps (cutting the batch into micro-batches, tracking
    the loss, the fit loop and callbacks): neither compiled calls nor waits. The first `skip`
    steps (tracing) are left out, and so are pairs that are not consecutive.

    Example:
        >>> from hyparflow.engine.events import Span, StepRecord
        >>> steps = [StepRecord(i, 10.0 * i, 10.0 * i + 9, 64, 1,
        ...                     (Span("forward", i, 0, 10.0 * i, 10.0 * i + 8),))
        ...          for i in range(5)]
        >>> loop_work(steps)
        [2.0, 2.0]
    """
    work = []
    for step, following in zip(records[skip:], records[skip + 1 :]):
        if following.step == step.step + 1:
            spans = sum(span.duration for span in step.spans)
            work.append(following.start - step.start - spans)
    return work


def _hops(steps_by_rank) -> dict:
    from hyparflow.engine import events

    sends, waits = [], []
    for first, second in list(zip(*steps_by_rank))[2:]:  # the first steps trace
        for sender, receiver in ((first, second), (second, first)):
            posted = {s.microbatch: s for s in sender.spans if s.kind == events.SEND}
            for span in receiver.spans:
                if span.kind != events.RECV or span.microbatch not in posted:
                    continue
                send = posted[span.microbatch]
                sends.append(send.duration)
                if span.start < send.end:  # the receiver was waiting for it
                    waits.append(span.end - send.end)
    return {"send_s": sends, "handoff_s": waits}


def reducer_time(comm, nbytes: int, repeats: int, pieces: int = 16) -> float:
    """Median time of hyparflow's `GradientReducer` summing `pieces` gradients of `nbytes`."""
    import tensorflow as tf
    from mpi4py import MPI

    from hyparflow.comm.allreduce import GradientReducer

    grads = [tf.ones((nbytes // 4 // pieces,), tf.float32) for _ in range(pieces)]
    reducer = GradientReducer(comm, specs=grads, op="sum")
    samples = []
    for i in range(repeats + 2):
        comm.Barrier()
        start = time.perf_counter()
        result = [tf.convert_to_tensor(g) for g in reducer.reduce(grads)]  # as the trainer does
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        del result
        if i >= 2:
            samples.append(elapsed)
    return statistics.median(samples)


def fit_network(
    pingpong: dict, allreduce: dict, reducer: dict, hops: dict, ranks: int,
    unpartitioned: list | None = None,
) -> dict:  # fmt: skip
    """Turn the timings (seconds by size in bytes; `hops` from `engine_hops`, `unpartitioned`
    from `unpartitioned_loop_work`) into `Network.from_dict` fields."""
    sizes = sorted(pingpong)
    latency = pingpong[sizes[0]]
    large = [n for n in sizes if n >= 1 << 20]
    slope = np.polyfit(large, [pingpong[n] for n in large], 1)[0]
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    share = (ranks - 1) / ranks
    # what the links do in the bandwidth-optimal algorithms; the rest is the arithmetic
    wire = {n: 2 * share * n / bandwidth + 2 * np.log2(ranks) * latency for n in allreduce}
    arithmetic = [(share * n, allreduce[n] - wire[n]) for n in sorted(allreduce)]
    per_byte = np.polyfit([a for a, _ in arithmetic], [t for _, t in arithmetic], 1)[0]
    reduce_rate = 1.0 / per_byte if per_byte > 0 else None
    # the engine's transfer: a fixed handoff plus the bytes at an effective bandwidth
    (small, small_hops), (large, large_hops) = sorted(hops.items())
    handoff_small = statistics.median(small_hops["handoff_s"])
    handoff_large = statistics.median(large_hops["handoff_s"])
    handoff_slope = max(0.0, (handoff_large - handoff_small) / (large - small))
    handoff = max(0.0, handoff_small - handoff_slope * small - latency)
    # hyparflow's reduction: per gradient (copy in, wrap out) and per byte (the copies)
    one_mib, large = 1 << 20, 16 << 20
    per_tensor = max(0.0, (reducer[one_mib, 64] - reducer[one_mib, 4]) / 60)
    copy_per_byte = (reducer[large, 16] - allreduce[large] - 16 * per_tensor) / large
    first = [t for h in hops.values() for t in h.get("loop_first_s", [])]
    last = [t for h in hops.values() for t in h.get("loop_last_s", [])]
    return {
        "intra": {"latency": latency, "bandwidth": bandwidth},
        "inter": None,
        "reduce_rate": reduce_rate,
        "overhead": statistics.median(small_hops["send_s"] + large_hops["send_s"]),
        "handoff": handoff,
        "handoff_bandwidth": 1.0 / handoff_slope if handoff_slope > 0 else None,
        "copy_rate": 1.0 / copy_per_byte if copy_per_byte > 0 else None,
        "per_tensor": per_tensor,
        "loop_first": statistics.median(first) if first else 0.0,
        "loop_last": statistics.median(last) if last else 0.0,
        "loop_unpartitioned": statistics.median(unpartitioned) if unpartitioned else 0.0,
        "source": {
            "measured": "hyparflow.simulate.netbench",
            "ranks": ranks,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "pingpong_one_way_s": {str(n): t for n, t in pingpong.items()},
            "allreduce_s": {str(n): t for n, t in allreduce.items()},
            "engine_hops": {str(n): h for n, h in hops.items()},
            "reducer_s": {f"{n} bytes in {k}": t for (n, k), t in reducer.items()},
        },
    }


def run(comm, repeats: int = 30) -> dict | None:
    """Every measurement on ranks 0 and 1 of `comm`; rank 0 returns the fitted network, with
    the cores the two ranks got over the run in its source (about 2 when nobody else ran)."""
    started = (time.process_time(), time.perf_counter())
    pingpong = {n: one_way(comm, n, repeats) for n in PINGPONG_SIZES}
    allreduce = {n: allreduce_time(comm, n, 2 * repeats) for n in ALLREDUCE_SIZES}
    reducer = {
        (n, pieces): reducer_time(comm, n, 2 * repeats, pieces)
        for n, pieces in ((1 << 20, 4), (1 << 20, 64), (16 << 20, 16))
    }
    hops = engine_hops(comm)
    unpartitioned = unpartitioned_loop_work(comm)
    share = (time.process_time() - started[0]) / (time.perf_counter() - started[1])
    cores_got = comm.allreduce(share)
    if comm.Get_rank() != 0:
        return None
    network = fit_network(pingpong, allreduce, reducer, hops, comm.Get_size(), unpartitioned)
    network["source"]["cores_got"] = cores_got
    return network


def _spin(buffer: np.ndarray, iterations: int) -> None:
    """Processor work on one core (element-wise numpy: no BLAS threads)."""
    for _ in range(iterations):
        np.multiply(buffer, 1.000001, out=buffer)


def oversubscribed_idle_share(comm, cores: int, repeats: int = 5) -> float | None:
    """The first `cores` ranks compute a fixed amount while the others either sleep or wait
    in MPI (a barrier, as a pipeline rank waits for its neighbour); rank 0 returns the share
    of a core a waiting rank takes from the computing ones (median over `repeats`; 0: the
    waiting ranks cost nothing, 1: each took as much as a computing rank)."""
    rank, waiting = comm.Get_rank(), comm.Get_size() - cores
    buffer = np.ones(16 * 1024, dtype=np.float32)  # 64 KiB: in cache, on one core
    # how much work is about 0.2 s on a core (the others sleep meanwhile)
    iterations = 0
    if rank < cores:
        start = time.perf_counter()
        _spin(buffer, 2000)
        iterations = int(2000 * 0.2 / max(time.perf_counter() - start, 1e-6))
    else:
        time.sleep(0.5)
    iterations = comm.allreduce(iterations, op=_max())
    ratios = []
    for _ in range(repeats):
        alone = _timed_spin(comm, rank < cores, buffer, iterations, sleep=True)
        shared = _timed_spin(comm, rank < cores, buffer, iterations, sleep=False)
        if rank == 0:
            ratios.append(shared / alone)
    if rank != 0:
        return None
    return min(1.0, max(0.0, (statistics.median(ratios) - 1.0) * cores / waiting))


def _timed_spin(comm, computes: bool, buffer, iterations: int, sleep: bool) -> float:
    """Seconds the computing ranks take for `iterations` while the others sleep through it
    (`sleep`, 5x the expected time) or wait in a barrier."""
    comm.Barrier()
    seconds = 0.0
    if computes:
        start = time.perf_counter()
        _spin(buffer, iterations)
        seconds = time.perf_counter() - start
    elif sleep:
        time.sleep(1.0)
    comm.Barrier()
    return seconds


def _max():
    from mpi4py import MPI

    return MPI.MAX


def oversubscribed_one_way(comm, cores: int, repeats: int = 200) -> float | None:
    """While the first `cores` ranks compute (as the other stages of a pipeline do), the rest
    ping-pong 8 bytes in pairs; rank 0 returns the first pair's median one-way time:
    a message's wait for the scheduler to run its receiver (the median, not the fastest)."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    pingers = (size - cores) // 2 * 2
    first = cores  # first pinging rank
    samples = []
    comm.Barrier()
    if rank < cores:
        buffer = np.ones(16 * 1024, dtype=np.float32)
        while not comm.Iprobe(source=first, tag=10):
            _spin(buffer, 20)
        comm.recv(source=first, tag=10)
    elif rank < first + pingers:
        buffer = np.zeros(1, dtype=np.uint8)
        me = rank - first
        peer = first + (me ^ 1)
        for i in range(repeats + 10):
            start = time.perf_counter()
            if me % 2 == 0:
                comm.Send(buffer, dest=peer, tag=9)
                comm.Recv(buffer, source=peer, tag=9)
            else:
                comm.Recv(buffer, source=peer, tag=9)
                comm.Send(buffer, dest=peer, tag=9)
            if i >= 10:
                samples.append((time.perf_counter() - start) / 2)
        if rank == first:
            requests = [comm.isend(None, dest=r, tag=10) for r in range(cores)]
            MPI.Request.Waitall(requests)
    comm.Barrier()
    median = comm.bcast(statistics.median(samples) if rank == first else None, root=first)
    return median if rank == 0 else None


def oversubscribed_wakeup(comm, cores: int, repeats: int = 200) -> float | None:
    """As `oversubscribed_one_way`, but the first `cores` ranks compute without making an MPI
    call (which would yield) for WAKEUP_CHUNK_S at a time, as a rank inside a TensorFlow
    call does, and the pingers pause a random fraction of a millisecond between round trips
    so that messages arrive at any point of the computing rank's time slice; rank 0 returns
    the first pair's mean one-way time: how long a woken rank waits for the scheduler to
    take the core from a rank that keeps computing (`sharing.wake_wait`)."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    pingers = (size - cores) // 2 * 2
    first = cores
    buffer = np.ones(16 * 1024, dtype=np.float32)
    start = time.perf_counter()
    _spin(buffer, 200)
    per_spin = max((time.perf_counter() - start) / 200, 1e-9)
    samples = []
    comm.Barrier()
    if rank < cores:
        chunk = max(1, int(WAKEUP_CHUNK_S / per_spin))
        while not comm.Iprobe(source=first, tag=12):
            _spin(buffer, chunk)
        comm.recv(source=first, tag=12)
    elif rank < first + pingers:
        token = np.zeros(1, dtype=np.uint8)
        me = rank - first
        peer = first + (me ^ 1)
        pauses = np.random.default_rng(rank).uniform(0.0, 1e-3, repeats + 10)
        for i in range(repeats + 10):
            if me % 2 == 0:
                _spin(buffer, int(pauses[i] / per_spin))
                start = time.perf_counter()
                comm.Send(token, dest=peer, tag=11)
                comm.Recv(token, source=peer, tag=11)
                if i >= 10:
                    samples.append((time.perf_counter() - start) / 2)
            else:
                comm.Recv(token, source=peer, tag=11)
                comm.Send(token, dest=peer, tag=11)
        if rank == first:
            MPI.Request.Waitall([comm.isend(None, dest=r, tag=12) for r in range(cores)])
    comm.Barrier()
    mean = comm.bcast(statistics.fmean(samples) if rank == first else None, root=first)
    return mean if rank == 0 else None


def main(argv=None) -> int:
    from mpi4py import MPI

    argv = sys.argv[1:] if argv is None else argv
    comm = MPI.COMM_WORLD
    if "--oversubscribed" in argv:
        cores = int(argv[argv.index("--oversubscribed") + 1])
        # each waiting or pinging rank shares one core with a computing one, as the model
        # places ranks (simulate/sharing.py; left alone the kernel may instead give the
        # waiting ranks a core of their own for this launch)
        unpinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {sorted(unpinned)[comm.Get_rank() % cores % len(unpinned)]})
        one_way = oversubscribed_one_way(comm, cores)
        wakeup = oversubscribed_wakeup(comm, cores)
        idle_share = oversubscribed_idle_share(comm, cores)
        os.sched_setaffinity(0, unpinned)
        reducer = {n: reducer_time(comm, n, 20, 16) for n in (1 << 20, 4 << 20, 16 << 20)}
        if comm.Get_rank() == 0:
            with open(argv[0], "w") as f:
                json.dump({"one_way_s": one_way, "wakeup_one_way_s": wakeup,
                           "idle_share": idle_share, "reducer_s": reducer,
                           "ranks": comm.Get_size()}, f)  # fmt: skip
        return 0
    if comm.Get_size() != 2:
        print("netbench needs exactly 2 ranks: mpirun -np 2 python -m", __name__, file=sys.stderr)
        return 2
    network = run(comm)
    if network is not None:
        with open(argv[0], "w") as f:
            json.dump(network, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

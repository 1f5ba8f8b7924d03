"""Figure 3, gradient reduction: GradientReducer vs one raw MPI.Allreduce vs Horovod.

Run: .venv/bin/python benchmarks/gradient_reduction.py [--repeats 7] [--models resnet110,resnet50]
     (starts `mpirun -np 2` itself, once in .venv and once in .venv-compat, which has Horovod)

Random float32 gradients shaped like a model's trainable variables, summed over 2 ranks in
blocks of reductions per way, the ways interleaved (order rotated each repeat):

- hyparflow engine (flat): `GradientReducer.reduce_flat` of a fresh flat tensor (the step's
  compiled backward ends in the concat that makes it), in place; packing shown apart;
- GradientReducer on a list of tensors (shared layers, non-float32 variables), also on a
  background thread (`overlap_groups`);
- raw MPI.Allreduce of the same bytes, in place: one buffer reused (the list way's reference)
  or a fresh copy each call (the flat way's reference: the same memory conditions);
- Horovod (compat venv only): `hvd.grouped_allreduce(op=hvd.Sum)`, eager and in a
  `tf.function`, in its own launches (its negotiation thread slows other MPI calls).

Targets, for both of hyparflow's paths: hyparflow / raw <= 1.1 and hyparflow / Horovod (its
faster way) < 1.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import has_horovod, run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement, target  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

FIGURE = "allreduce"
TITLE = "(3) Gradient reduction: GradientReducer vs raw MPI.Allreduce vs Horovod"
LABELS = {
    "flat": "hyparflow engine: reduce_flat of the step's flat gradient tensor",
    "pack": "pack as a separate compiled call (in the engine: the step's last op)",
    "reducer": "GradientReducer, list of tensors (shared layers, non-float32)",
    "reducer_thread": "GradientReducer, background thread",
    "raw": "raw MPI.Allreduce, one buffer reused",
    "raw_fresh": "raw MPI.Allreduce, a fresh buffer each call",
    "horovod": "Horovod grouped_allreduce (eager)",
    "horovod_function": "Horovod grouped_allreduce (tf.function)",
    "raw_beside_horovod": "raw MPI.Allreduce, with Horovod initialized",
}

WAYS_WITH_TARGETS = (("flat", "engine (flat)"), ("reducer", "GradientReducer, list"))
# the raw Allreduce under the same memory conditions as the way
RAW_REFERENCE = {"flat": ("raw_fresh", "fresh buffer"), "reducer": ("raw", "reused buffer")}

# Ways whose input the engine's step produces: made fresh before each timed block.
PREPARE: dict = {}
PACKED: list = []
FRESH: list = []


def variables_of(name: str):
    import warnings

    import keras

    from benchmarks.models import cifar_resnet

    if name == "resnet50":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return keras.applications.ResNet50(weights=None).trainable_variables
    if name.startswith("resnet"):
        return cifar_resnet(int(name[len("resnet") :])).trainable_variables
    raise ValueError(f"unknown model {name!r}: resnet50 or resnet<depth> (CIFAR)")


def ways_for(comm, variables, grads, horovod: bool) -> dict:
    """One callable per way, each reducing `grads` once (blocking). With `horovod`, only
    Horovod's ways and the raw floor: Horovod's background thread runs an MPI negotiation every
    cycle, which slows the process's other MPI calls, so hyparflow's are timed without it."""
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    from hyparflow.comm.allreduce import GradientReducer
    from hyparflow.engine.gradients.flat import FlatLayout

    flat = np.concatenate([g.numpy().ravel() for g in grads])
    if horovod:
        import horovod.tensorflow as hvd

        hvd.init(comm=comm)
        compiled = tf.function(lambda gs: hvd.grouped_allreduce(gs, op=hvd.Sum))
        return {
            "horovod": lambda: hvd.grouped_allreduce(grads, op=hvd.Sum),
            "horovod_function": lambda: compiled(grads),
            "raw_beside_horovod": lambda: comm.Allreduce(MPI.IN_PLACE, flat),
        }
    reducer = GradientReducer(comm, specs=variables, op="sum")
    threaded = GradientReducer(comm, specs=variables, op="sum", background=True)
    layout = FlatLayout(variables)
    pack = tf.function(layout.flatten)
    flat_reducer = GradientReducer(comm, op="sum")
    one = tf.constant(1.0)
    PREPARE["flat"] = lambda count: PACKED.extend(pack(grads, one) for _ in range(count))
    PREPARE["raw_fresh"] = lambda count: FRESH.extend(flat.copy() for _ in range(count))
    return {
        "flat": lambda: flat_reducer.reduce_flat(PACKED.pop()),
        "pack": lambda: pack(grads, one),
        "reducer": lambda: reducer.reduce(grads),
        "reducer_thread": lambda: threaded.reduce(grads),
        "raw": lambda: comm.Allreduce(MPI.IN_PLACE, flat),
        "raw_fresh": lambda: comm.Allreduce(MPI.IN_PLACE, FRESH.pop()),
    }


def worker(args) -> None:
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if not args.horovod:  # what hf.fit does in every multi-rank process
        from hyparflow.launch.malloc import keep_temporaries_in_heap

        keep_temporaries_in_heap()
    results = {}
    for name in args.models.split(","):
        variables = variables_of(name)
        rng = np.random.default_rng(comm.Get_rank())
        grads = [tf.constant(rng.normal(size=v.shape).astype("float32")) for v in variables]
        ways = ways_for(comm, variables, grads, args.horovod)
        per_block = max(3, int(args.block_mib * 2**20 / sum(g.numpy().nbytes for g in grads)))
        # Warm-up: buckets, connections, Horovod's fusion buffer, and a whole block of the
        # engine's fresh tensors (whose heap pages a training run reuses every step).
        for way, call in ways.items():
            count = per_block if way in PREPARE else 1
            if way in PREPARE:
                PREPARE[way](count)
            for _ in range(count):
                call()
        seconds = {way: [] for way in ways}
        names = list(ways)
        for repeat in range(args.repeats):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for way in order:
                if way in PREPARE:  # untimed: the step built these, as in the engine
                    PREPARE[way](per_block)
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(per_block):
                    ways[way]()
                seconds[way].append((time.perf_counter() - start) / per_block)
        ms = {way: [1e3 * s for s in values] for way, values in seconds.items()}
        mib = sum(g.numpy().nbytes for g in grads) / 2**20
        results[name] = {"ms": ms, "tensors": len(grads), "mib": mib, "per_block": per_block}
    if comm.Get_rank() == 0:
        write_result(args.worker_out, 0, results)


def _launch(args, venv: str, horovod: bool, repeats: int) -> dict:
    worker_args = ["--repeats", repeats, *cli.flags(args, "models", "block_mib")]
    worker_args += ["--horovod"] if horovod else []
    return run_worker(__file__, worker_args, np=2, venv=venv)[0]


def run(args) -> list[dict]:
    records = []
    venvs = ["main"] + (["compat"] if has_horovod() else [])
    for venv in venvs:
        # hyparflow's ways and Horovod's run in separate launches (see ways_for), alternating.
        kinds = (False, True) if venv == "compat" else (False,)
        rounds = args.rounds if venv == "compat" else 1
        repeats = max(1, args.repeats // rounds)
        merged: dict = {}
        for round_ in range(rounds):
            for horovod in kinds if round_ % 2 == 0 else kinds[::-1]:
                for model, r in _launch(args, venv, horovod, repeats).items():
                    entry = merged.setdefault(model, {**r, "ms": {}})
                    for way, values in r["ms"].items():
                        entry["ms"].setdefault(way, []).extend(values)
        records += _records(merged, venv)
    return records


def _records(result: dict, venv: str) -> list[dict]:
    records = []
    for model, r in result.items():
        where = f"{model} ({r['tensors']} tensors, {r['mib']:.1f} MiB), {venv} venv"
        ms = r["ms"]
        records += [
            measurement(
                FIGURE,
                f"{LABELS[way]}: {where}",
                values,
                "ms",
                venv=venv,
                reductions_per_repeat=r["per_block"],
            )
            for way, values in ms.items()
        ]
        for way, name in WAYS_WITH_TARGETS:
            reference, buffer = RAW_REFERENCE[way]
            ratios = paired_ratios(ms[way], ms[reference])
            name = f"{name} / raw Allreduce ({buffer}): {where}"
            records.append(target(FIGURE, name, ratios, "<= 1.1"))
        if "horovod" in ms:
            best = [min(a, b) for a, b in zip(ms["horovod"], ms["horovod_function"], strict=True)]
            for way, name in WAYS_WITH_TARGETS:
                ratios = paired_ratios(ms[way], best)
                records.append(
                    target(FIGURE, f"{name} / Horovod (faster way): {where}", ratios, "< 1.0")
                )
    return records


def arguments(argv=None):
    p = cli.parser(__doc__, rounds=2)
    p.add_argument("--models", default="resnet110,resnet50")
    p.add_argument("--horovod", action="store_true", help="worker: also time Horovod")
    p.add_argument("--block-mib", type=float, default=400, help="MiB reduced per timed block")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.block_mib = "resnet20", 20
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)

"""Tensor parallelism (T=2) against data and pipeline parallel on 2 ranks; bytes moved and held.

Run: .venv/bin/python benchmarks/tensor_parallel.py [--repeats 7] [--steps 5] (starts mpirun)

Adam; a wide MLP (3 x Dense(4096, gelu) -> Dense(1024), batch 128) and a transformer block
(Dense(512) projection, 8-head attention and Dense(2048, gelu) -> Dense(512), residuals and
LayerNorms; 64 tokens, batch 16). Step time of a global batch: data parallel (R=2), 2-stage 1F1B
pipeline (4 micro-batches), tensor (T=2), `model.fit` on rank 0 alone; epochs interleaved.
Bytes per step (T=2): rank 0's `traffic("tensor")` over one more epoch against Megatron's 4
allreduces of b·s·h float32 per block (g after attention and after the Dense pair, f before each
in backward); attention copies its input once for Q, K, V, as Megatron's fused QKV (was 1.5x).
Bytes per rank: parameters (`trainer.variables`) and Adam slots measured at T=1 (data parallel)
and T=2; computed for T=1, 2, 4 from `tensor_layout(model, T).bytes_per_rank()` (slots: 2x).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

FIGURE, TITLE = "tensor", "Tensor parallelism: step time against data and pipeline, bytes"
SIZES = {"mlp": dict(h=1024, pairs=3, batch=128), "transformer": dict(h=512, seq=64, batch=16)}
QUICK = {"mlp": dict(h=64, pairs=1, batch=16), "transformer": dict(h=32, seq=8, batch=8)}
SETUPS, MIB = ("data parallel", "pipeline", "tensor", "one rank"), 2**20


def _model(size: dict):
    import keras
    from keras import layers as L

    keras.utils.set_random_seed(0)
    h = size["h"]
    x = inputs = keras.Input((size["seq"], h) if "seq" in size else (h,))
    for _ in range(size.get("pairs", 0)):
        x = L.Dense(h)(L.Dense(4 * h, activation="gelu")(x))
    if "seq" in size:  # after a trained projection, so that every f has a gradient to reduce
        x = L.Dense(h)(x)
        x = L.LayerNormalization()(L.Add()([x, L.MultiHeadAttention(8, h // 8)(x, x)]))
        up = L.Dense(4 * h, activation="gelu")(x)
        x = L.GlobalAveragePooling1D()(L.LayerNormalization()(L.Add()([x, L.Dense(h)(up)])))
    model = keras.Model(inputs, L.Dense(10, activation="softmax")(x))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def worker(args) -> None:
    import hyparflow as hf
    from benchmarks.harness.timing import interleaved_epochs
    from benchmarks.models import synthetic_data
    from hyparflow.comm.in_graph import traffic
    from hyparflow.engine.weights import nbytes
    from hyparflow.tensor import tensor_layout

    size, on = (QUICK if args.quick else SIZES)[args.model], dict(tune_process=True)
    strategies = [
        hf.Strategy("data", **on),
        hf.Strategy("model", microbatches=4, schedule="1f1b", **on),
        hf.Strategy("data", tensor=2, **on),
        None,
    ]
    setups = {name: (_model(size), s) for name, s in zip(SETUPS, strategies, strict=True)}
    x, y = synthetic_data(setups["tensor"][0], size["batch"] * args.steps)
    seconds = interleaved_epochs(setups, x, y, size["batch"], args.repeats, steps=args.steps)
    (model, tensor), moved = setups["tensor"], traffic("tensor")
    moved.reset()  # one more epoch of `args.steps` steps, counted
    hf.fit(model, x, y, batch_size=size["batch"], verbose=0, strategy=tensor)
    if hf.rank() == 0:
        write_result(
            args.worker_out,
            0,
            {
                "seconds": seconds,
                "megatron": 4 * size["batch"] * size.get("seq", 0) * size["h"] * 4,
                "calls": moved.calls / args.steps,
                "bytes": moved.bytes / args.steps,
                "held": {
                    t: (
                        sum(map(nbytes, m._hyparflow_trainer[1].variables)),  # params, slots
                        sum(nbytes(v) for v in m.optimizer.variables if len(v.shape)),
                    )
                    for t, m in ((1, setups["data parallel"][0]), (2, model))
                },
                "layout": {t: sum(tensor_layout(model, t).bytes_per_rank()) for t in (1, 2, 4)},
            },
        )


def run(args) -> list[dict]:
    records = []
    for name in SIZES:
        flags = ["--model", name, *cli.flags(args, "repeats", "steps")] + ["--quick"] * args.quick
        r = run_worker(__file__, flags, np=2)[0]
        ms = {k: [1e3 * s / args.steps for s in v] for k, v in r["seconds"].items()}
        rows = [(f"{k}, ms per step", v, "ms") for k, v in ms.items()]
        rows += [
            (f"{k} / data parallel step time", paired_ratios(ms[k], ms["data parallel"]), "ratio")
            for k in ("pipeline", "tensor")
        ]
        rows += [
            (f"speed-up over one rank, {k}", paired_ratios(ms["one rank"], ms[k]), "ratio")
            for k in SETUPS[:3]
        ]
        if r["megatron"]:
            per_step = [("measured", r["bytes"]), ("Megatron's 4 x b·s·h·4", r["megatron"])]
            rows += [(f"bytes per step, {k}", [v / MIB], "MiB per step") for k, v in per_step]
            ratio = r["bytes"] / r["megatron"]
            rows += [
                ("bytes per step, measured / Megatron's", [ratio], "ratio"),
                ("collectives per step (Megatron: 4)", [r["calls"]], "calls"),
            ]
        records += [measurement(FIGURE, f"{name}: {what}", v, unit) for what, v, unit in rows]
        held = [(t, "measured", pair) for t, pair in r["held"].items()]
        held += [(t, "computed from the layout", (b, 2 * b)) for t, b in r["layout"].items()]
        records += [
            measurement(
                FIGURE,
                f"{name}: {what} per rank, T={t}, {how}",
                [n / MIB],
                "MiB",
                series=f"{name}: {what}, {how}",
                x=int(t),
                x_label="tensor ranks T",
            )
            for t, how, pair in held
            for what, n in zip(("parameters", "Adam slots"), pair, strict=True)
        ]
    return records


def arguments(argv=None):
    p = cli.parser(__doc__, steps=5)
    p.add_argument("--model", choices=sorted(SIZES), help="worker: which model")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)

"""Scaling model against real runs: predicted vs measured step time, a core per rank.

Run: .venv/bin/python benchmarks/simulator_validation.py [--models mlp,cnn] [--rounds 3]
     (starts mpirun itself; a few minutes per model and round on 2 cores)

Layouts that give every rank a core here: one rank, data parallel 1 x 2, model parallel 2 x 1
(1F1B, 4 micro-batches); global batch 256; an MLP and a small ResNet-style CNN. Every round,
in one-thread processes after waiting for an idle machine: the network is measured
(`netbench`), then the model's costs (`measure`, on core 0); each layout is predicted, then
trained with `hf.fit` (the pipeline split where the simulator balances it; step = start to
start, mean over ranks, first epoch left out). Error = median predicted / median measured - 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
from benchmarks.harness import cli, quiet  # noqa: E402
from benchmarks.harness.launch import MPI_ENV, run_worker, thread_env, write_result  # noqa: E402

# glibc keeps TensorFlow's large temporaries in the heap instead of mapping and unmapping
# them every step (page faults that two ranks paying at once slowed each other by)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 31)}
ENV = {**MPI_ENV, **thread_env(1), **MALLOC}
CONFIGS = [(1, 1), (1, 2), (2, 1)]  # (partitions, replicas): a core per rank on 2 cores


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per configuration")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4, help="for pipelines")
    parser.add_argument("--steps", type=int, default=12, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=6, help="per run; the first traces")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "simulator.json"))
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "CONFIG", "STARTS"))
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set by harness.launch
    parser.add_argument("--calibrate", nargs=2, metavar=("MODEL", "COSTS"))
    return parser.parse_args(argv)


def build_model(kind: str):
    """The two validation models (seeded): an MLP and a small pre-activation ResNet."""
    import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    if kind == "mlp":
        inputs = x = keras.Input((256,), name="features")
        for i in range(6):
            x = layers.Dense(512, activation="relu", name=f"dense_{i}")(x)
    elif kind == "cnn":
        inputs = keras.Input((16, 16, 3), name="images")
        x = layers.Conv2D(16, 3, padding="same", name="stem")(inputs)
        for stage, width in enumerate((16, 32, 64)):
            for block in range(2):
                stride, name = (2 if stage > 0 and block == 0 else 1), f"s{stage}b{block}"
                y = layers.BatchNormalization(name=f"{name}_bn1")(x)
                y = layers.Activation("relu", name=f"{name}_relu1")(y)
                y = layers.Conv2D(width, 3, strides=stride, padding="same", name=f"{name}_conv1")(y)
                y = layers.BatchNormalization(name=f"{name}_bn2")(y)
                y = layers.Activation("relu", name=f"{name}_relu2")(y)
                y = layers.Conv2D(width, 3, padding="same", name=f"{name}_conv2")(y)
                if stride != 1 or x.shape[-1] != width:
                    x = layers.Conv2D(width, 1, strides=stride, name=f"{name}_proj")(x)
                x = layers.Add(name=f"{name}_add")([x, y])
        x = layers.GlobalAveragePooling2D(name="pool")(x)
    else:
        raise ValueError(f"unknown model {kind!r}: use mlp or cnn")
    outputs = layers.Dense(10, activation="softmax", name="classes")(x)
    model = keras.Model(inputs, outputs, name=f"validation_{kind}")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def worker(args) -> None:
    """One measured run under mpirun: `hf.fit`, each rank's mean step period to a file."""
    import keras

    import hyparflow as hf
    from benchmarks.models import synthetic_data

    model_path, config, starts = args.worker
    partitions, replicas, microbatches = (int(v) for v in config.split("x"))
    model = keras.saving.load_model(model_path)
    x, y = synthetic_data(model, args.batch_size * args.steps)
    kind = "data" if partitions == 1 else ("model" if replicas == 1 else "hybrid")
    balance = starts.split(",") if starts != "-" else "layers"
    strategy = hf.Strategy(
        kind,
        partitions=partitions,
        replicas=replicas,
        microbatches=microbatches,
        schedule="1f1b",
        balance=balance,
        tune_process=True,
    )
    stamps, epoch = [], [0]  # (epoch, each step's start)
    timer = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: epoch.__setitem__(0, e),
        on_train_batch_begin=lambda b, logs: stamps.append((epoch[0], time.perf_counter())),
    )
    timer.needs_batch_logs = False  # it reads a clock, not the logs
    fit = dict(batch_size=args.batch_size, epochs=args.epochs, verbose=0, callbacks=[timer])
    hf.fit(model, x, y, strategy=strategy, **fit)
    # from one step's start to the next within an epoch, from the second (the first traces)
    periods = [b - a for (e, a), (f, b) in zip(stamps, stamps[1:], strict=False) if e == f >= 1]
    write_result(args.worker_out, hf.rank(), {"step_period": statistics.mean(periods)})


def calibrate(args) -> None:
    """Measure the model's costs in this (one-thread) process."""
    import keras

    from hyparflow.simulate.measure import measure_model

    model_path, costs_path = args.calibrate
    model = keras.saving.load_model(model_path)
    one_rank = (args.batch_size // 2, args.batch_size)  # the sizes the single rank trains at
    measure_model(model, batch_sizes=(32, 128), fit_batch_sizes=one_rank).save(costs_path)


def wait_for_quiet() -> None:
    """Wait (up to 20 minutes) until under 15% of the machine is busy; the load average lags."""
    quiet.wait_for_quiet(max_load=float("inf"), patience=1200)


def _run(command: list[str], timeout: float = 900) -> None:
    wait_for_quiet()
    result = subprocess.run(
        command, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")


def measure(args, model_path: str, layout, starts: list[str]) -> float:
    """Milliseconds per step of one `hf.fit` run of `layout` (mean over the ranks)."""
    config = f"{layout.partitions}x{layout.replicas}x{layout.microbatches}"
    flags = ["--worker", model_path, config, ",".join(starts) or "-"]
    wait_for_quiet()
    ranks = run_worker(
        __file__,
        flags + cli.flags(args, "batch_size", "steps", "epochs"),
        np=layout.world,
        timeout=900,
        env=MALLOC,
    )
    return 1e3 * statistics.mean(r["step_period"] for r in ranks)


def main(argv=None) -> None:
    args = _arguments(argv)
    if args.worker:
        return worker(args)
    if args.calibrate:
        return calibrate(args)
    from hyparflow.simulate import Layout, Machine, ModelCosts, Network, predict
    from hyparflow.simulate.netbench import launch

    folder = tempfile.mkdtemp(prefix="hf-simulator-validation-")
    kinds = args.models.split(",")
    layouts = [Layout(p, r, args.microbatches if p > 1 else 1) for p, r in CONFIGS]
    runs = {kind: {layout: [] for layout in layouts} for kind in kinds}
    for kind in kinds:
        code = (
            f"import sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks."
            f"simulator_validation import build_model; build_model({kind!r}).save("
            f"{os.path.join(folder, kind + '.keras')!r})"
        )
        _run([sys.executable, "-c", code])
    for round_ in range(args.rounds):
        wait_for_quiet()
        network = Network.from_dict(launch(os.path.join(folder, "network.json")))
        print(f"round {round_}: {network.intra}, reduce {network.reduce_rate:.3g} B/s", flush=True)
        for kind in kinds:
            model_path, costs_path = (os.path.join(folder, kind + e) for e in (".keras", ".json"))
            _run(
                [
                    "taskset",
                    "-c",
                    "0",
                    sys.executable,
                    __file__,
                    "--calibrate",
                    model_path,
                    costs_path,
                    "--batch-size",
                    str(args.batch_size),
                ]
            )
            costs = ModelCosts.load(costs_path)
            for layout in layouts if round_ % 2 == 0 else layouts[::-1]:
                p = predict(costs, network, layout, args.batch_size, Machine(os.cpu_count()))
                measured = measure(args, model_path, layout, p.stage_names)
                runs[kind][layout].append((measured, p.step_time * 1e3))
                print(
                    f"{kind} {layout.partitions}x{layout.replicas} round {round_}: measured "
                    f"{measured:.2f} ms, predicted {p.step_time * 1e3:.2f} ms",
                    flush=True,
                )
    rows = {kind: [_row(layout, runs[kind][layout]) for layout in layouts] for kind in kinds}
    print(_table(rows, args.batch_size))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "models": rows}, f, indent=1)
    print(f"written: {args.out}")


def _row(layout, results: list[tuple[float, float]]) -> dict:
    """Medians over the rounds of (measured, predicted) ms, and the error of the medians.

    >>> from types import SimpleNamespace as Layout
    >>> pipeline = Layout(partitions=2, replicas=1, microbatches=4)
    >>> _row(pipeline, [(10.0, 9.0), (12.0, 11.0), (11.0, 12.0)])["error"]
    0.0
    """
    measured = statistics.median(m for m, _ in results)
    predicted = statistics.median(p for _, p in results)
    return {
        "partitions": layout.partitions,
        "replicas": layout.replicas,
        "microbatches": layout.microbatches,
        "measured_ms": measured,
        "predicted_ms": predicted,
        "error": predicted / measured - 1,
        "measured_ms_all": [m for m, _ in results],
        "predicted_ms_all": [p for _, p in results],
    }


def _table(rows: dict, batch: int) -> str:
    """One table: a row per model and layout."""
    lines = [
        f"\nglobal batch {batch}, 1F1B; ms per step, medians over rounds (range); "
        "error = median predicted / median measured - 1",
        f"{'model':<6} {'P x R':>6} {'M':>3} {'measured':>9} {'range':>13} "
        f"{'predicted':>10} {'range':>13} {'error':>7}",
    ]
    for kind, model_rows in rows.items():
        for r in model_rows:
            spans = [
                f"{min(r[k]):.1f}-{max(r[k]):.1f}" for k in ("measured_ms_all", "predicted_ms_all")
            ]
            lines.append(
                f"{kind:<6} {r['partitions']:>2} x {r['replicas']:<2} "
                f"{r['microbatches']:>3} {r['measured_ms']:>9.2f} {spans[0]:>13} "
                f"{r['predicted_ms']:>10.2f} {spans[1]:>13} "
                f"{r['error']:>+7.1%}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

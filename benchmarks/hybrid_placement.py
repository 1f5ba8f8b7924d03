"""Hybrid on a node short of cores: stages mixed on each core vs stage-pure cores vs unpinned.

Run: .venv/bin/python benchmarks/hybrid_placement.py [--models mlp,cnn] [--rounds 5]
     (starts mpirun itself; about 1 minute per round and model on 2 cores)

A 2 x 2 hybrid job (2 stages, 2 replicas, 1F1B, 4 micro-batches, global batch 256) of the
scaling model's validation models (`simulator_validation.py`) on the 4 ranks of a 2-core
node, trained with `hf.fit`, its ranks placed three ways:

- mixed (what `hf.fit` does, `hyparflow.launch.affinity.deal_to_cores`): each core holds one
  replica's first stage and the other replica's second stage, so one replica's fill and drain
  run beside the other's steady state;
- stage-pure: local rank i on core i mod 2 (hyparflow's placement before 2026-11-25), so both
  first stages share a core and that core's pair idles through the drain, the other's
  through the fill; the benchmark deals so by replacing `deal_to_cores` in the workers;
- unpinned (`HYPARFLOW_PIN_RANKS=0`): the kernel places every thread.

The step is the time from one step's start to the next, mean over the ranks, the first epoch
left out (`simulator_validation.py`'s `StepPeriod`). The placements alternate within a round,
the order rotated each round; ratios are paired per round. The scaling model's prediction of
the two pinned placements (`shared_pipeline` on the same schedule with the stages' work
equal) is printed beside: its ideal gain, with no per-message or optimizer costs.
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
from benchmarks.harness.launch import MPI_ENV, thread_env  # noqa: E402
from benchmarks.harness.quiet import busy_fraction  # noqa: E402
from benchmarks.simulator_validation import ENV as VALIDATION_ENV  # noqa: E402

PLACEMENTS = ("mixed", "stage-pure", "unpinned")
BATCH, MICROBATCHES, STEPS, EPOCHS = 256, 4, 12, 4


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "PLACEMENT", "OUT"))
    return parser.parse_args(argv)


def worker(kind: str, placement: str, out: str) -> None:
    """One 2 x 2 hf.fit; every rank writes its mean step period (s) and its threads' cores."""
    import keras

    import hyparflow as hf
    from benchmarks.simulator_validation import _data, _step_period_callback, build_model
    from hyparflow.launch import affinity

    if placement == "stage-pure":
        affinity.deal_to_cores = lambda stages, cores: [i % cores for i in range(len(stages))]
    keras.config.disable_interactive_logging()
    model = build_model(kind)
    x, y = _data(model, BATCH * STEPS)
    period = _step_period_callback()
    strategy = hf.Strategy("hybrid", partitions=2, replicas=2, microbatches=MICROBATCHES,
                           schedule="1f1b")  # fmt: skip
    hf.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, strategy=strategy,
           callbacks=[period])  # fmt: skip
    cores = sorted({min(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")})
    with open(os.path.join(out, f"rank_{hf.rank()}.json"), "w") as f:
        json.dump({"step_s": statistics.mean(period.periods), "cores": cores}, f)


def measure(kind: str, placement: str) -> dict:
    """Run one placement under mpirun after the machine has been quiet; mean step in ms."""
    while busy_fraction(2.0) > 0.15:
        time.sleep(5)
    with tempfile.TemporaryDirectory(prefix="hf-placement-") as out:
        env = {**os.environ, **MPI_ENV, **thread_env(1), **VALIDATION_ENV}
        if placement == "unpinned":
            env["HYPARFLOW_PIN_RANKS"] = "0"
        command = ["mpirun", "-np", "4", "--bind-to", "none", sys.executable, __file__,
                   "--worker", kind, placement, out]  # fmt: skip
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"{placement} failed:\n{result.stderr[-3000:]}")
        ranks = []
        for rank in range(4):
            with open(os.path.join(out, f"rank_{rank}.json")) as f:
                ranks.append(json.load(f))
    return {
        "step_ms": 1e3 * statistics.mean(r["step_s"] for r in ranks),
        "cores": [r["cores"] for r in ranks],
    }


def modelled_gain() -> float:
    """The scaling model's stage-pure / mixed makespan for this schedule, equal stages."""
    from hyparflow.engine.schedule import make_schedule
    from hyparflow.simulate.sharing import simulate_shared

    schedule, forward, backward = make_schedule("1f1b", 2, MICROBATCHES), [1.0] * 2, [2.0] * 2
    pure = simulate_shared(schedule, forward, backward, 0.0, [{0: 2}, {1: 2}], cores=1)
    mixed = simulate_shared(schedule, forward, backward, 0.0, [{0: 1, 1: 1}] * 2, cores=1)
    return pure.makespan / mixed.makespan


def main(argv=None) -> None:
    args = _arguments(argv)
    if args.worker:
        return worker(*args.worker)
    print(f"2 x 2 hybrid, 4 ranks on {os.cpu_count()} cores, 1F1B, {MICROBATCHES} micro-batches, "
          f"batch {BATCH}; scaling model's stage-pure / mixed, equal stages: "
          f"{modelled_gain():.3f}")  # fmt: skip
    for kind in args.models.split(","):
        steps: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
        for round_ in range(args.rounds):
            order = PLACEMENTS[round_ % 3 :] + PLACEMENTS[: round_ % 3]
            for placement in order:
                run = measure(kind, placement)
                steps[placement].append(run["step_ms"])
                print(f"{kind} round {round_} {placement:<10} {run['step_ms']:7.2f} ms  "
                      f"cores of ranks 0-3: {run['cores']}", flush=True)  # fmt: skip
        print(f"{kind}: median step (ms) over {args.rounds} rounds, paired ratios' median")
        for placement in PLACEMENTS:
            ratios = [a / b for a, b in zip(steps[placement], steps["mixed"])]
            print(f"  {placement:<10} {statistics.median(steps[placement]):7.2f} "
                  f"(range {min(steps[placement]):.2f}-{max(steps[placement]):.2f})  "
                  f"/ mixed {statistics.median(ratios):.3f} "
                  f"(range {min(ratios):.3f}-{max(ratios):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()

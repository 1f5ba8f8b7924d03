"""A pipeline on too few cores, step by step: where its time goes, and the model replayed on it.

Run: .venv/bin/python benchmarks/crowded_pipeline_timeline.py [--models mlp,cnn] [--epochs 6]
     (starts mpirun itself; about a minute per configuration on 2 cores)

Trains the scaling model's validation models (`simulator_validation.build_model`) with
`hf.fit` on 4 ranks of this 2-core machine (4 x 1 and 2 x 2, 1F1B, 4 micro-batches, global
batch 256, the partitioner's default split, ranks pinned as hyparflow pins them) and
records every rank's spans with the engine's recorder (`hyparflow.engine.events`), the
first epoch (tracing) and the first step of the next left out. From the recorded steps:

- **wake-up gaps**: for each action whose input came from a neighbour while its rank was
  already waiting, the time from the sender's action end to its start, split by whether
  a rank sharing the receiver's core was computing when the sender finished
  (`sharing.wake_wait`: the receiver then waits for that rank's scheduler tick);
- **actions alone**: each stage's median forward and backward while no rank on its core
  computed (under 2% overlap);
- **replay**: the shared-core simulation (`sharing.shared_pipeline`) fed those measured
  action times and the median gap with an idle core-mate as the message time, with and
  without the wake-up wait (`--wakeup`, ms; 0 leaves it out) and the switching cost
  (`--timeslice`), against the measured pipeline span (the first action's start to the
  last action's end over all ranks). Calibration plays no part: this checks the scheduling
  model alone.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
from benchmarks.simulator_validation import ENV  # noqa: E402  (the validation's rank settings)

CONFIGS = [(4, 1), (2, 2)]  # (partitions, replicas): 4 ranks on 2 cores
MICROBATCHES = 4
BATCH = 256
STEPS = 12  # per epoch
COMPUTE = ("forward", "backward")


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--wakeup", type=float, default=2.0, help="ms; the netbench W")
    parser.add_argument("--timeslice", type=float, default=1.1)
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "P", "R", "OUT"))
    return parser.parse_args(argv)


def worker(args) -> None:
    """One recorded `hf.fit` under mpirun; rank 0 pickles every rank's steps to OUT."""
    import keras
    from mpi4py import MPI

    import hyparflow as hf
    from benchmarks.simulator_validation import _data, build_model
    from hyparflow.engine import events
    from hyparflow.launch.affinity import deal_to_cores

    keras.config.disable_interactive_logging()
    kind, p, r, out = args.worker
    p, r = int(p), int(r)
    model = build_model(kind)
    x, y = _data(model, BATCH * STEPS)
    recorder = events.Recorder()

    class Record(keras.callbacks.Callback):
        needs_batch_logs = False

        def attach_trainer(self, trainer):
            self.trainer = trainer
            trainer.attach_recorder(recorder)

        def on_train_end(self, logs=None):
            self.trainer.attach_recorder(None)

    strategy = hf.Strategy("hybrid", partitions=p, replicas=r, microbatches=MICROBATCHES,
                           schedule="1f1b")  # fmt: skip
    hf.fit(model, x, y, batch_size=BATCH, epochs=args.epochs, verbose=0, callbacks=[Record()],
           strategy=strategy)  # fmt: skip
    steps = [[(s.kind, s.microbatch, s.start, s.end) for s in record.spans]
             for record in recorder.take()]  # fmt: skip
    everyone = MPI.COMM_WORLD.gather(steps, root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        cores = deal_to_cores([rank % p for rank in range(p * r)], 2)
        with open(out, "wb") as f:
            pickle.dump({"p": p, "r": r, "cores": cores, "steps": everyone}, f)


def _overlap(intervals, start, end) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)


def analyse(recorded: dict) -> dict:
    """Gaps, actions alone and the measured span from one recorded run."""
    p, r, cores, steps = recorded["p"], recorded["r"], recorded["cores"], recorded["steps"]
    world = p * r
    first = STEPS + 1  # the traced epoch and the next epoch's first step left out
    gaps, alone, spans = defaultdict(list), defaultdict(list), []
    for i in range(first, min(len(s) for s in steps) - 1):
        acts = {q: [(k, m, a, b) for k, m, a, b in steps[q][i] if k in COMPUTE]
                for q in range(world)}  # fmt: skip
        busy = {q: [(a, b) for _, _, a, b in acts[q]] for q in range(world)}
        spans.append(max(b for q in acts for *_, b in acts[q])
                     - min(a for q in acts for _, _, a, _ in acts[q]))  # fmt: skip
        for q in range(world):
            stage, replica = q % p, q // p
            mates = [o for o in range(world) if o != q and cores[o] == cores[q]]
            previous_end = None
            for kind, m, a, b in acts[q]:
                if max((_overlap(busy[o], a, b) for o in mates), default=0.0) < 0.02 * (b - a):
                    alone[stage, kind].append(b - a)
                source = stage - 1 if kind == "forward" else stage + 1
                if 0 <= source < p and previous_end is not None:
                    sent = [e for k, mm, _, e in acts[replica * p + source]
                            if k == kind and mm == m]  # fmt: skip
                    if sent and previous_end < sent[0]:
                        computing = any(x <= sent[0] < y for o in mates for x, y in busy[o])
                        gaps["mate computing" if computing else "mate waiting"].append(a - sent[0])
                previous_end = b
    return {"p": p, "r": r, "gaps": gaps, "alone": alone, "span": statistics.median(spans)}


def replay(found: dict, wakeup: float, timeslice: float) -> float:
    """The shared-core simulation of the recorded run from its own measured action times."""
    from hyparflow.engine.schedule import one_f_one_b
    from hyparflow.simulate.sharing import shared_pipeline

    p, r = found["p"], found["r"]
    forward = [statistics.median(found["alone"][s, "forward"]) for s in range(p)]
    backward = [statistics.median(found["alone"][s, "backward"]) for s in range(p)]
    message = statistics.median(found["gaps"]["mate waiting"])
    run = shared_pipeline(one_f_one_b(p, MICROBATCHES), forward, backward, message,
                          [[0] * r] * p, cores=2, idle_share=0.0, timeslice=timeslice,
                          wakeup=wakeup)  # fmt: skip
    return max(run.finish)


def main(argv=None) -> None:
    args = _arguments(argv)
    if args.worker:
        return worker(args)
    folder = tempfile.mkdtemp(prefix="hf-crowded-timeline-")
    for kind in args.models.split(","):
        for p, r in CONFIGS:
            out = os.path.join(folder, f"{kind}-{p}x{r}.pkl")
            command = ["mpirun", "-np", str(p * r), "--bind-to", "none", sys.executable,
                       __file__, "--worker", kind, str(p), str(r), out,
                       "--epochs", str(args.epochs)]  # fmt: skip
            done = subprocess.run(command, env={**os.environ, **ENV}, capture_output=True,
                                  text=True, timeout=900)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
            with open(out, "rb") as f:
                found = analyse(pickle.load(f))
            print(f"\n{kind} {p} x {r}: pipeline span {1e3 * found['span']:.2f} ms (median)")
            for key in ("mate waiting", "mate computing"):
                values = found["gaps"][key]
                if values:
                    print(f"  gap, {key}: {len(values)} messages, median "
                          f"{1e3 * statistics.median(values):.2f} ms, mean "
                          f"{1e3 * statistics.fmean(values):.2f} ms")  # fmt: skip
            for s in range(p):
                f, b = (found["alone"][s, k] for k in COMPUTE)
                print(f"  stage {s} alone: forward {1e3 * statistics.median(f):.2f} ms, "
                      f"backward {1e3 * statistics.median(b):.2f} ms ({len(f)}, {len(b)} "
                      "actions)")  # fmt: skip
            for label, wakeup, timeslice in (
                ("processor sharing", 0.0, 1.0),
                ("+ switching cost", 0.0, args.timeslice),
                ("+ wake-up waits", args.wakeup / 1e3, args.timeslice),
            ):
                simulated = replay(found, wakeup, timeslice)
                print(f"  replay, {label}: {1e3 * simulated:.2f} ms "
                      f"({simulated / found['span'] - 1:+.1%})")  # fmt: skip


if __name__ == "__main__":
    main()

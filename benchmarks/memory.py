"""Memory plan vs measured: each rank's peak resident growth next to hf.memory_plan's prediction.

Run: .venv/bin/python benchmarks/memory.py [--shape 2048,6] [--layouts 1,1,1 2,1,1 ...]

A weight-heavy MLP (tests/mpi/memory_checks.py: Dense(WIDTH) x DEPTH on 256 inputs, Adam,
batch 32, one epoch of 4 steps) is trained by 1, 2 and 4 ranks along each axis (P, R, T; R
with ZeRO-1 where `hf.Strategy` has `shard_optimizer`), ordinary build and `hf.scope()`. Each
rank's growth is measured from before the model is built to the epoch's end (PeakGrowth);
the table shows the largest rank and the worst error over ranks (docs/memory.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
import hyparflow as hf  # noqa: E402
from tests.support.mpirun import run_scenario  # noqa: E402

MIB = 2**20
LAYOUTS = ["1,1,1", "2,1,1", "4,1,1", "1,2,1", "1,4,1", "1,1,2", "1,1,4", "2,2,1", "2,1,2",
           "4,1,1,scope", "2,1,2,scope", "1,4,1,zero"]  # fmt: skip


def has_zero() -> bool:
    return "shard_optimizer" in {f.name for f in dataclasses.fields(hf.Strategy)}


def measure(spec: str, shape: str) -> list[dict]:
    p, r, t = (int(v) for v in spec.split(",")[:3])
    return run_scenario("memory_checks", p * r * t, "measure", spec, shape, timeout=600)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2048,6", help="WIDTH,DEPTH of the MLP")
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, help='"P,R,T[,scope|zero]"')
    args = parser.parse_args(argv)
    print(f"MLP {args.shape} (width, depth), Adam, batch 32; MiB per rank\n")
    print("| layout (P,R,T) | largest rank: measured | predicted | error | worst error |")
    print("|---|---|---|---|---|")
    for spec in args.layouts:
        if "zero" in spec and not has_zero():
            print(f"| {spec} | not run: hf.Strategy has no shard_optimizer yet | | | |")
            continue
        results = measure(spec, args.shape)
        errors = [r["predicted"] / r["growth"] - 1 for r in results]
        top = max(results, key=lambda r: r["growth"])
        worst = max(errors, key=abs)
        print(
            f"| {spec} | {top['growth'] / MIB:.0f} | {top['predicted'] / MIB:.0f} | "
            f"{top['predicted'] / top['growth'] - 1:+.0%} | {worst:+.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

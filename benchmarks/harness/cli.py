"""The command line every figure script shares: driver mode, or worker mode under a launcher."""

from __future__ import annotations

import argparse

from benchmarks.harness.records import emit

HELP = {
    "steps": "steps per epoch",
    "epochs": "epochs per run; the first traces",
    "rounds": "rounds of launches, the order alternating",
    "microbatch_rows": "rows in each micro-batch (the batch is m times that)",
}


def parser(doc: str, repeats: int = 7, **numbers) -> argparse.ArgumentParser:
    """Common options: `--repeats` (after warm-up), `--quick` (a smoke run), `--out` (JSON),
    and an integer option per keyword of `numbers` (`batch_size=32`: `--batch-size`, 32)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--repeats", type=int, default=repeats, help="measured repeats after warm-up")
    p.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats: a smoke test")
    p.add_argument("--out", help="also write the records to this JSON file")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)  # set by harness.launch
    for name, default in numbers.items():
        flag = f"--{name.replace('_', '-')}"
        p.add_argument(flag, type=int, default=default, help=HELP.get(name))
    return p


def flags(args, *names: str) -> list:
    """`--name value` for each attribute `names` of `args`: what a driver hands its worker."""
    return [item for name in names for item in (f"--{name.replace('_', '-')}", getattr(args, name))]


def entry(args, worker, run) -> list[dict] | None:
    """Run as a worker when launched by the harness, else drive the figure and print records."""
    if args.worker_out:
        worker(args)
        return None
    if args.quick:
        args.repeats = min(args.repeats, 2)
    return emit(run(args), args.out)

"""Memory per rank: peak growth next to hf.memory_plan, ZeRO-1's bytes, the largest MLP under a cap.

Run: .venv/bin/python benchmarks/memory.py [--quick] [--shape 2048,6] [--cap 640M] [--probes 3]
     (starts `mpirun` itself; 4 ranks oversubscribe 2 cores, which does not change memory)

MLP: Dense(WIDTH) x DEPTH on 256 inputs (tests/mpi/memory_checks.py), Adam, batch 32, 4 steps.
Growth: each rank's peak resident growth from the model's build to the epoch's end, the
largest rank's next to `hf.memory_plan`'s, for 1, 2 and 4 ranks along P, T, R, R with ZeRO-1,
and P=4, R=2, R=4 (also with ZeRO-1), P=2 x T=2 under `hf.scope()` (updating by segment).
ZeRO-1: bytes a rank sends per step (reduce-scatter + all-gather) next to an allreduce's. Cap: each
rank in its own cgroup (tests/support/cgroup.py; ~214 MiB of it is Python, TensorFlow, MPI); a
bisection over the width of a depth-8 MLP finds the largest that trains one epoch (built under
`hf.scope()` on 4 ranks; in one process hf.fit refuses what its plan says does not fit).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402

FIGURE, MIB = "memory", 2**20
TITLE = "(7) Memory per rank: peak growth vs the plan, ZeRO-1's bytes, the largest MLP under a cap"
LAYOUTS = [
    "1,1,1",
    "2,1,1",
    "4,1,1",
    "4,1,1,scope",
    "1,1,2",
    "1,1,4",
    "1,2,1",
    "1,4,1",
    "1,2,1,scope",
    "1,4,1,scope",
    "1,2,1,zero",
    "1,4,1,zero",
    "1,4,1,zero,scope",
    "1,2,1,zero2",
    "1,4,1,zero2",
    "1,4,1,zero2,scope",
    "2,1,2",
    "2,1,2,scope",
]
CAPPED = ["1,1,1", "4,1,1,params,scope", "2,1,2,scope", "1,4,1,scope", "1,4,1,zero,scope"]


def label(spec: str) -> str:
    """ "2,1,2,scope" as "P=2 x T=2, hf.scope()"."""
    p, r, t, *flags = spec.split(",")
    axes = [f"{a}={n}" for a, n in zip("PRT", (p, r, t), strict=True) if int(n) > 1]
    named = (("zero", "ZeRO-1"), ("zero2", "ZeRO-2"), ("scope", "hf.scope()"))
    extra = [name for flag, name in named if flag in flags]
    return ", ".join([" x ".join(axes) or "one process", *extra])


def size(spec: str) -> int:
    return math.prod(int(n) for n in spec.split(",")[:3])


def worker(args) -> None:
    import hyparflow as hf
    from tests.mpi.memory_checks import measure

    write_result(args.worker_out, hf.rank(), measure(args.layout, args.shape))


def growth_records(spec: str, ranks: list[dict]) -> list[dict]:
    top = max(ranks, key=lambda r: r["growth"])
    worst = max((r["predicted"] / r["growth"] - 1 for r in ranks), key=abs)
    rows = [
        ("peak growth, largest rank, measured", top["growth"] / MIB, "MiB"),
        ("peak growth, largest rank, plan", top["predicted"] / MIB, "MiB"),
        ("plan / measured - 1, worst rank", 100 * worst, "%"),
    ]
    if "zero_bytes" in top:  # every replica sends the same
        zero, allreduce = sum(top["zero_bytes"].values()) / MIB, top["allreduce_bytes"] / MIB
        rows += [
            ("bytes sent per step, reduce-scatter + all-gather", zero, "MiB per step"),
            ("bytes sent per step, an allreduce instead", allreduce, "MiB per step"),
            ("ZeRO-1 bytes / allreduce bytes", zero / allreduce, "ratio"),
        ]
    return [measurement(FIGURE, f"{label(spec)}: {what}", [v], unit) for what, v, unit in rows]


def largest_width(spec: str, args) -> list[dict]:
    """Bisect the width (multiples of 128, geometric) in `args.widths` under the cap: of the
    widths probed, the largest that trained and the smallest that did not (killed for memory)."""
    from tests.support.cgroup import launch_capped

    (low, high), probed = args.widths, set()
    for _ in range(args.probes):
        probed.add(width := round((low * high) ** 0.5 / 128) * 128)
        run, caps = launch_capped(
            "memory_checks", size(spec), args.cap, "measure", spec, f"{width},8", timeout=600
        )
        trained = run.returncode == 0 and all(run.results)
        how = "trained" if trained else f"{[o and o.killed_for_memory for o in caps]} killed"
        print(f"{label(spec)}, width {width}: {how}", file=sys.stderr, flush=True)
        low, high = (width, high) if trained else (low, width)
    ends = (("largest width trained", low), ("smallest width not trained", high))
    return [
        measurement(FIGURE, f"{label(spec)}: {what} under {args.cap} per rank", [w], "width")
        for what, w in ends
        if w in probed
    ]


def run(args) -> list[dict]:
    from tests.support.cgroup import skip_reason

    records = []
    for spec in args.layouts:
        ranks = run_worker(__file__, ["--layout", spec, "--shape", args.shape], np=size(spec))
        records += growth_records(spec, ranks)
    if reason := skip_reason():  # the report's heading says so
        args.title = f"{TITLE} (caps not run: {reason})"
        print(f"caps not run: {reason}", file=sys.stderr)
        return records
    return records + [r for spec in args.capped for r in largest_width(spec, args)]


def arguments(argv=None):
    p = cli.parser(__doc__, repeats=1)
    p.add_argument("--layouts", nargs="+", default=LAYOUTS, help='"P,R,T[,scope|zero]"')
    p.add_argument("--shape", default="2048,6", help="WIDTH,DEPTH of the growth runs' MLP")
    p.add_argument("--capped", nargs="+", default=CAPPED, help="layouts bisected under the cap")
    p.add_argument("--cap", default="640M", help="per-rank memory cap (cgroup)")
    p.add_argument("--widths", type=int, nargs=2, default=[512, 4096], help="bisection range")
    p.add_argument("--probes", type=int, default=3, help="probes per capped layout")
    p.add_argument("--layout", help="worker: the layout it measures")
    args = p.parse_args(argv)
    if args.quick:
        args.layouts, args.shape, args.capped = ["1,1,1", "1,2,1,zero"], "256,2", CAPPED[-1:]
        args.cap, args.widths, args.probes = "1G", [256, 768], 1
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)

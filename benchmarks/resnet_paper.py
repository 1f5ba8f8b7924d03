"""Figure 6, the paper's shape of work: a deep, narrow CIFAR ResNet, hybrid/model parallel vs
Horovod data parallel and vs one process.

Run: .venv/bin/python benchmarks/resnet_paper.py [--depth 110] [--image 32] [--batch-size 32]
     [--rounds 2] [--ranks 2 4]   (starts `mpirun` itself; runs in .venv-compat, with Horovod)

HyPar-Flow (Awan et al. 2020) reports 1.6x over Horovod for ResNet-1001 and 3.1x for model
parallel over sequential on ResNet-110. This figure runs the same shapes of work, scaled to
seconds (samples/s over the epochs after the first): Keras `model.fit` in one process (1
thread, one per core); hyparflow model parallel (1F1B, stages balanced by measured layer
time), data parallel and hybrid P x R; the Horovod loop of figure 4. Rows with more ranks than
cores measure overheads, not scaling. Ratios are paired per round.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import has_horovod, run_worker  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

FIGURE = "resnet"
TITLE = "(6) The paper's shape of work: CIFAR ResNet, hyparflow vs Horovod vs one process"


def configurations(ranks_list, cores: int) -> list[dict]:
    """Every measured configuration: (way, partitions, replicas, threads)."""
    configs = [{"way": "keras", "p": 1, "r": 1, "threads": t} for t in sorted({1, cores})]
    for ranks in ranks_list:
        if has_horovod():
            configs.append({"way": "horovod", "p": 1, "r": ranks, "threads": 1})
        configs.append({"way": "hyparflow", "p": 1, "r": ranks, "threads": 1})
        configs.append({"way": "hyparflow", "p": ranks, "r": 1, "threads": 1})
        if ranks >= 4:
            configs.append({"way": "hyparflow", "p": 2, "r": ranks // 2, "threads": 1})
    return configs


def label(config: dict, cores: int) -> str:
    p, r, ranks = config["p"], config["r"], config["p"] * config["r"]
    if config["way"] == "keras":
        return f"Keras model.fit, 1 process, {config['threads']} thread(s)"
    over = " (oversubscribed)" if ranks > cores else ""
    if config["way"] == "horovod":
        return f"Horovod loop, data parallel {ranks} ranks{over}"
    kind = "data parallel" if p == 1 else ("model parallel" if r == 1 else "hybrid")
    return f"hyparflow {kind} {p}x{r}{over}"


def worker(args) -> None:
    import hyparflow as hf
    from benchmarks.data_parallel import train_ways
    from benchmarks.models import cifar_resnet

    kind = "data" if args.p == 1 else ("model" if args.r == 1 else "hybrid")
    m = args.microbatches if args.p > 1 else 1
    strategy = hf.Strategy(
        kind,
        partitions=args.p,
        replicas=args.r,
        microbatches=m,
        schedule="1f1b",
        balance="time",
        tune_process=True,
    )
    train_ways(args, cifar_resnet(args.depth, image=args.image), args.batch_size, strategy)


def run(args) -> list[dict]:
    cores = os.cpu_count() or 1
    configs = configurations(args.ranks, cores)
    rates = {label(c, cores): [] for c in configs}
    fixed = cli.flags(args, "depth", "image", "batch_size", "steps", "epochs", "microbatches")
    for round_ in range(args.rounds):
        for config in configs if round_ % 2 == 0 else configs[::-1]:
            way = ["--way", config["way"], "--p", config["p"], "--r", config["r"]]
            result = run_worker(
                __file__,
                [*way, *fixed],
                np=config["p"] * config["r"],
                venv="compat" if has_horovod() else "main",
                threads=config["threads"],
                timeout=3600,
            )
            rates[label(config, cores)].append(statistics.median(result[0]))
    shape = f"ResNet-{args.depth}, {args.image}x{args.image} images, batch {args.batch_size}"
    records = [
        measurement(FIGURE, f"{name} ({shape})", values, "samples/s")
        for name, values in rates.items()
    ]
    one = rates[label({"way": "keras", "p": 1, "r": 1, "threads": 1}, cores)]
    whole = rates[label({"way": "keras", "p": 1, "r": 1, "threads": cores}, cores)]
    for ranks in args.ranks:
        model_parallel = rates[label({"way": "hyparflow", "p": ranks, "r": 1}, cores)]
        data_parallel = rates[label({"way": "hyparflow", "p": 1, "r": ranks}, cores)]
        mp = f"model parallel {ranks}x1"
        pairs = [
            (f"{mp} / Keras 1 thread (paper: 3.1x on ResNet-110)", model_parallel, one),
            (f"{mp} / Keras {cores} threads", model_parallel, whole),
        ]
        if has_horovod():
            horovod = rates[label({"way": "horovod", "p": 1, "r": ranks}, cores)]
            best, kind = model_parallel, "model parallel"
            if ranks >= 4:
                hybrid = {"way": "hyparflow", "p": 2, "r": ranks // 2}
                best, kind = rates[label(hybrid, cores)], "hybrid"
            paper = "(paper: 1.6x on ResNet-1001)"
            pairs += [
                (f"hyparflow {kind} / Horovod, {ranks} ranks {paper}", best, horovod),
                (f"hyparflow data parallel / Horovod, {ranks} ranks", data_parallel, horovod),
            ]
        records += [
            measurement(FIGURE, name, paired_ratios(a, b), "ratio", depth=args.depth)
            for name, a, b in pairs
        ]
    return records


def arguments(argv=None):
    p = cli.parser(__doc__, batch_size=32, microbatches=4, steps=6, epochs=3, rounds=2)
    p.add_argument("--depth", type=int, default=110, help="6n+2 (basic) or 9n+2 (bottleneck)")
    p.add_argument("--image", type=int, default=32, help="image side (CIFAR: 32)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--way", choices=["keras", "hyparflow", "horovod"], help="worker: how")
    p.add_argument("--p", type=int, default=1, help="worker: partitions")
    p.add_argument("--r", type=int, default=1, help="worker: replicas")
    args = p.parse_args(argv)
    if args.quick:
        args.depth, args.image, args.batch_size, args.steps, args.epochs = 20, 16, 16, 2, 2
        args.rounds, args.ranks = 1, [2]
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)

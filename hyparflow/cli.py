"""The `hyparflow` command line: `hyparflow run -n 4 train.py`, `hyparflow plan MODEL.keras`, ...

`hyparflow run` must start in a fraction of a second (it only builds a command line), so the
other commands import TensorFlow, Keras and the package's heavy modules in their own functions
rather than at module level.
"""

from __future__ import annotations

import argparse
import json
import sys

from hyparflow.partitioner.source import CUSTOM_OBJECTS_HELP, load_model

MEASURE_WORKER = "_measure-worker"  # auto/measure_worker.py's COMMAND: one rank of --measure


def main(argv=None) -> int:
    """Run the `hyparflow` command; returns the exit status.

    Example:
        $ hyparflow run -n 4 train.py --epochs 10
        $ hyparflow plan model.keras --partitions 4 --balance time --batch-size 64
        $ hyparflow plan --auto model.keras --ranks 8 --batch 256 --memory 16GiB
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # before the parser: its simulate options import Keras
        from hyparflow.run import main as run

        return run(argv[1:], prog="hyparflow run")
    if argv[:1] == ["plan"] and "--auto" in argv:  # the planner's options (auto/command.py)
        from hyparflow.auto import command as auto_command

        return auto_command.plan(argv[1:], memory_of=_memory_of, launch_facts=_launch_facts)
    if argv[:1] == [MEASURE_WORKER]:  # hf.fit is above the planner's layer: handed in here
        from hyparflow.api import fit
        from hyparflow.auto import measure_worker

        return measure_worker.main(argv[1:], fit)
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyparflow",
        description="Plan and inspect data, model and hybrid parallel training of Keras models.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    commands.add_parser(  # listed for --help; main() hands `run` to hyparflow.run first
        "run",
        add_help=False,
        help="start a script on N ranks: srun --mpi=pmix inside Slurm, mpirun elsewhere "
        "(hyparflow run --help)",
    )
    _add_plan_command(commands)
    _add_report_command(commands)
    _add_simulate_command(commands)
    return parser


def _add_plan_command(commands):
    plan = commands.add_parser(
        "plan",
        help="split a saved model into pipeline stages and print the plan (plan --auto: "
        "search every layout of N ranks, hyparflow plan --auto --help)",
        description="Split a saved Keras model into balanced pipeline stages; print the table.",
        epilog=_auto_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "model", help="a saved Keras model (.keras file), or module:function that builds one"
    )
    plan.add_argument("--custom-objects", metavar="MODULE", help=CUSTOM_OBJECTS_HELP)
    plan.add_argument("--partitions", "-p", type=int, required=True, help="number of stages")
    plan.add_argument(
        "--balance",
        default="layers",
        help='"layers" (default), "params", "flops", "time", or comma-separated layer names '
        "where stages 1, 2, ... begin",
    )
    plan.add_argument("--batch-size", type=int, help="samples per batch (profiling, traffic)")
    plan.add_argument(
        "--input-shape",
        type=_shape,
        help='input shape without the batch dimension, e.g. "224,224,3" (for --balance time)',
    )
    plan.add_argument(
        "--bandwidth", type=float, help="bytes per unit of cost; adds communication to stages"
    )
    plan.add_argument(
        "--tensor",
        "-t",
        type=int,
        default=1,
        help="tensor ranks splitting each stage's layers: show the layout and bytes per rank",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead")
    plan.add_argument(
        "--auto",
        action="store_true",
        help="instead: search every layout of N ranks for the model and print the fastest "
        "that fits, with options of its own (hyparflow plan --auto --help; docs/auto.md)",
    )
    _add_memory_options(plan.add_argument_group("memory plan (--memory; docs/memory.md)"))
    plan.add_argument(
        "--hosts",
        help='mpirun\'s host list, e.g. "nodeA:4,nodeB:4": also print the node of each rank '
        "(with --replicas and --tensor: the whole grid) as hf.fit places them (docs/nodes.md)",
    )
    plan.set_defaults(run=_run_plan)


def _auto_help() -> str:
    """`plan --auto`'s own options, shown under `plan --help` (its parser is auto/command.py's)."""
    from hyparflow.auto import command as auto_command

    return f"hyparflow plan --auto: the planner\n\n{auto_command.plan_parser().format_help()}"


def _add_memory_options(memory) -> None:
    """`hyparflow plan --memory`'s options: the strategy whose memory it predicts."""
    memory.add_argument(
        "--memory",
        action="store_true",
        help="print every rank's predicted peak bytes instead (needs --batch-size)",
    )
    memory.add_argument(
        "--replicas", "-r", type=int, default=1, help="data-parallel replicas (and --hosts)"
    )
    memory.add_argument("--microbatches", "-m", type=int, default=1, help="micro-batches")
    memory.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b", "zero_bubble"))
    memory.add_argument("--recompute", action="store_true", help="recompute activations")
    memory.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="the optimizer state split over the replicas (ZeRO-1, docs/zero.md)",
    )
    memory.add_argument(
        "--shard-gradients",
        action="store_true",
        help="the gradients too, reduce-scattered segment by segment (ZeRO-2)",
    )
    memory.add_argument(
        "--shard-weights",
        action="store_true",
        help="the weights too, gathered for each segment's calls (ZeRO-3, FSDP)",
    )
    memory.add_argument(
        "--optimizer", help="count this optimizer's state (e.g. adam) when the file has none"
    )


def _placement(args) -> list[dict] | None:
    """Each rank's node and grid place for `--hosts` (None without it)."""
    from hyparflow.comm.placement import placement_table
    from hyparflow.comm.topology import Grid
    from hyparflow.launch.command import fill_slots, parse_hosts

    if not args.hosts:
        return None
    grid = Grid(args.partitions, args.replicas, args.tensor)
    hosts = parse_hosts(args.hosts)
    counts = fill_slots([slots or 1 for _, slots in hosts], grid.size)  # mpirun's by-slot fill
    if sum(counts) < grid.size:
        raise ValueError(f"--hosts {args.hosts!r} has {sum(counts)} slots for {grid.size} ranks")
    names = [name for (name, _), count in zip(hosts, counts, strict=True) for _ in range(count)]
    return placement_table(names, grid)


def _print_plan(plan, args, placement: list[dict] | None) -> int:
    """The plan (or memory plan), then each rank's node (`placement`, from `--hosts`)."""
    if args.json:
        document = json.loads(plan.to_json())
        print(json.dumps(document if placement is None else {**document, "placement": placement}))
        return 0
    print(plan.summary(print_fn=None))
    if placement is not None:
        nodes = len({row["node"] for row in placement})
        print(
            f"\nPlacement on {nodes} node(s) (hf.fit deals tensor groups, then pipelines, "
            "node by node):"
        )
        header = ["rank", "node", "stage", "replica", "shard"]
        rows = [header] + [[str(row[key]) for key in header] for row in placement]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for row in rows:
            print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    return 0


def _run_plan(args) -> int:
    from hyparflow.api import partition

    try:  # `--hosts` is checked before the model is loaded (LaunchError is a ValueError)
        placement = _placement(args)
    except ValueError as error:
        print(f"hyparflow plan: {error}", file=sys.stderr)
        return 1
    if args.memory:
        return _run_memory_plan(args, placement)
    model = _load_or_report(args, compile=False)
    if model is None:
        return 1
    balance = args.balance
    if balance not in ("layers", "params", "flops", "time"):
        balance = [name.strip() for name in balance.split(",") if name.strip()]
    try:
        plan = partition(
            model,
            args.partitions,
            balance=balance,
            input_shape=args.input_shape,
            batch_size=args.batch_size,
            bandwidth=args.bandwidth,
            tensor=args.tensor,
        )
    except ValueError as error:
        print(f"hyparflow plan: {error}", file=sys.stderr)
        return 1
    return _print_plan(plan, args, placement)


def _load_or_report(args, compile: bool):
    """`args.model` loaded, or None after saying on stderr why it cannot be."""
    try:
        return load_model(args.model, args.custom_objects, compile=compile)
    except ValueError as error:
        print(f"hyparflow plan: {error}", file=sys.stderr)
        return None


def _run_memory_plan(args, placement: list[dict] | None) -> int:
    from hyparflow.memory import memory_plan
    from hyparflow.strategy import Strategy

    try:
        model = load_model(args.model, args.custom_objects)  # compiled: its optimizer's slots
    except Exception:  # a loss or optimizer this process cannot rebuild: count none
        model = _load_or_report(args, compile=False)
    if model is None:
        return 1
    if args.optimizer:
        model.compile(optimizer=args.optimizer)
    balance = args.balance
    if balance not in ("layers", "params", "flops", "time"):
        balance = [name.strip() for name in balance.split(",") if name.strip()]
    kind = "hybrid" if args.partitions > 1 and args.replicas > 1 else "auto"
    try:
        strategy = Strategy(
            kind,
            partitions=args.partitions,
            replicas=args.replicas,
            microbatches=args.microbatches,
            schedule=args.schedule,
            balance=balance,
            recompute=args.recompute,
            tensor=args.tensor,
            shard_optimizer=args.shard_optimizer,
            shard_gradients=args.shard_gradients,
            shard_weights=args.shard_weights,
        )
        plan = memory_plan(model, strategy, batch_size=args.batch_size or 32)
    except ValueError as error:
        print(f"hyparflow plan: {error}", file=sys.stderr)
        return 1
    return _print_plan(plan, args, placement)


def _add_report_command(commands):
    report = commands.add_parser(
        "report",
        help="print a profiled run's per-rank table and draw its pipeline Gantt chart",
        description="Summarize what hf.callbacks.ScalingProfiler wrote to LOG_DIR: time per "
        "step on each rank, pipeline bubble, throughput, scaling efficiency; draw the PNG.",
    )
    report.add_argument("log_dir", help="the log_dir given to ScalingProfiler")
    report.add_argument("--png", help="where to write the Gantt chart (LOG_DIR/timeline.png)")
    report.add_argument(
        "--steps", type=_steps, help='timeline steps to draw, e.g. "3" or "2-4" (first three)'
    )
    report.set_defaults(run=_run_report)


def _run_report(args) -> int:
    from hyparflow.callbacks.report import report

    try:
        text, png = report(args.log_dir, png=args.png, steps=args.steps)
    except (FileNotFoundError, ValueError) as error:
        print(f"hyparflow report: {error}", file=sys.stderr)
        return 1
    print(text)
    print(f"Gantt chart: {png}" if png else "No timeline.json: no Gantt chart drawn.")
    return 0


def _add_simulate_command(commands):
    from hyparflow.auto import command as auto_command
    from hyparflow.simulate import command

    simulate = commands.add_parser(
        "simulate",
        help="predict step time, throughput and efficiency of P partitions x R replicas",
        description="Predict hyparflow's training throughput and scaling efficiency for P "
        "partitions x R replicas on N nodes, from per-layer costs (measured here from a .keras "
        "model, or read from a costs file) and a latency/bandwidth network model (given or "
        "measured). See docs/simulate.md.",
    )
    command.add_arguments(simulate)
    auto_command.add_arguments(simulate)
    simulate.set_defaults(run=_run_simulate)


def _run_simulate(args) -> int:
    from hyparflow.auto import command as auto_command
    from hyparflow.simulate import command

    if args.auto is not None:
        return auto_command.run(args, memory_of=_memory_of)
    return command.run(args)


def _memory_of(model, batch_size: int, whole_model: bool | None = None):
    """The planner's bytes of a layout (auto/choose.py), imported only with a model: it
    imports Keras. `whole_model`: as `hf.memory_plan` takes it (None: the model's build)."""
    from hyparflow.auto.choose import memory_of

    return memory_of(model, batch_size, whole_model=whole_model)


def _launch_facts():
    """This machine's facts as `hyparflow run` reads them, for `plan --auto --measure`'s jobs."""
    from hyparflow.run import facts_here

    return facts_here()


def _steps(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def _shape(text: str) -> tuple:
    return tuple(None if d.strip() in ("", "None") else int(d) for d in text.split(","))


if __name__ == "__main__":
    sys.exit(main())

"""`hyparflow simulate`: costs and network from the command line to a table of predictions."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

from hyparflow.simulate.costs import ModelCosts
from hyparflow.simulate.network import Link, Network
from hyparflow.simulate.predict import Layout, Machine, Prediction, efficiency, predict, speedup

COLUMNS = (
    ("P", 3), ("R", 4), ("M", 3), ("ranks", 6), ("nodes", 6), ("step ms", 10),
    ("samples/s", 11), ("speed-up", 9), ("efficiency", 11), ("bubble", 7),
    ("allreduce ms", 13), ("cpu share", 10),
)  # fmt: skip


def add_arguments(parser) -> None:
    """The `simulate` subcommand's options."""
    parser.add_argument(
        "source",
        help="a saved Keras model (.keras: its layers are timed here) or a costs file (.json, "
        "from --save-costs)",
    )
    parser.add_argument("--batch-size", type=int, required=True, help="global batch per step")
    parser.add_argument("--partitions", "-p", type=_ints, default=[1], help='e.g. "1,2,4"')
    parser.add_argument("--replicas", "-r", type=_ints, default=[1], help='e.g. "1,2,4"')
    parser.add_argument(
        "--microbatches", "-m", type=int, default=1, help="per step, for pipelines (P > 1)"
    )
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument("--nodes", type=int, help="spread each layout over this many nodes")
    parser.add_argument("--ranks-per-node", type=int, help="ranks on each node (fills nodes)")
    parser.add_argument(
        "--cores-per-node",
        type=int,
        help="cores that run ranks on a node (default: those of the machine the costs were "
        "measured on); more ranks than cores share them",
    )
    parser.add_argument(
        "--background", type=float, default=0.0, help="cores kept busy by other jobs"
    )
    parser.add_argument(
        "--corun",
        type=float,
        default=1.0,
        help="how much slower a core computes while the node's other cores run ranks too "
        "(measured: benchmarks/simulator_validation.py; 1.0: not at all)",
    )
    parser.add_argument(
        "--timeslice",
        type=float,
        default=1.0,
        help="how much more processor time a rank's work takes while its core switches "
        "between it and other computing ranks (more ranks than cores; measured: "
        "benchmarks/simulator_validation.py; 1.0: none)",
    )
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="ranks short of cores are not pinned (HYPARFLOW_PIN_RANKS=0): average over the "
        "ways the kernel may place them",
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="coefficient of variation of a rank's compute per step (e.g. 0.02): replicas "
        "wait for the slowest at their allreduce",
    )
    net = parser.add_argument_group("network (Hockney alpha-beta links)")
    net.add_argument("--latency", type=float, help="inter-node latency in seconds, e.g. 2e-6")
    net.add_argument("--bandwidth", type=float, help="inter-node bytes/s, e.g. 12e9")
    net.add_argument("--intra-latency", type=float, help="intra-node latency in seconds")
    net.add_argument("--intra-bandwidth", type=float, help="intra-node bytes/s")
    net.add_argument("--network", help="a network file written by --save-network")
    net.add_argument(
        "--measure-network",
        action="store_true",
        help="measure the intra-node link and hyparflow's message costs here (mpirun, 2 ranks)",
    )
    net.add_argument("--save-network", help="write the network used to this JSON file")
    model = parser.add_argument_group("measuring a .keras model")
    model.add_argument("--save-costs", help="write the measured costs to this JSON file")
    model.add_argument(
        "--profile-batch-sizes",
        type=_ints,
        default=[16, 64],
        help="two batch sizes to time the layers at (default 16,64)",
    )
    model.add_argument("--input-shape", type=_shape, help='e.g. "32,32,3" (unknown dimensions)')
    parser.add_argument(
        "--baseline",
        choices=("rank", "node"),
        default="rank",
        help="speed-up over one rank (default) or over the same layout on one node",
    )
    parser.add_argument(
        "--batch-logs",
        action="store_true",
        help="callbacks read every batch's logs (verbose=1, ScalingProfiler): the loop shares "
        "them after each step",
    )
    parser.add_argument("--json", action="store_true", help="print the predictions as JSON")


def run(args) -> int:
    """Resolve costs and network, predict every (P, R), print the table."""
    try:
        costs = _costs(args)
        network = _network(args)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"hyparflow simulate: {error}", file=sys.stderr)
        return 1
    cores = args.cores_per_node or costs.measured.get("cores")
    machine = Machine(
        cores_per_node=cores,
        background=args.background,
        jitter=args.jitter,
        corun=args.corun,
        pinned=not args.unpinned,
        timeslice=args.timeslice,
    )
    rows, skipped = [], []
    for partitions in args.partitions:
        for replicas in args.replicas:
            layout = _layout(args, partitions, replicas)
            try:
                prediction = predict(
                    costs, network, layout, args.batch_size, machine, batch_logs=args.batch_logs
                )
                base = _baseline(args, costs, network, machine, layout)
            except ValueError as error:
                skipped.append(f"{partitions}x{replicas}: {error}")
                continue
            rows.append((prediction, base))
    if args.json:
        print(json.dumps([_row_dict(p, b) for p, b in rows], indent=1))
    else:
        print(table(costs, network, machine, args, rows))
    for reason in skipped:
        print(f"skipped {reason}", file=sys.stderr)
    return 0 if rows else 1


def table(costs, network, machine, args, rows) -> str:
    """The printed result: a header on the inputs, one row per layout."""
    lines = [
        f"Scaling model for {costs.name}: global batch {args.batch_size}, "
        f"{args.schedule} schedule, {len(costs.layers)} layers, "
        f"{costs.param_bytes / 2**20:.1f} MiB of gradients",
        _network_line(network, machine),
        "".join(name.rjust(width) for name, width in COLUMNS),
    ]
    for prediction, base in rows:
        layout = prediction.layout
        values = (
            layout.partitions, layout.replicas, layout.microbatches, layout.world,
            prediction.nodes, f"{prediction.step_time * 1e3:.2f}",
            f"{prediction.throughput:,.0f}", f"{speedup(prediction, base):.2f}",
            f"{efficiency(prediction, base):.1%}", f"{prediction.bubble:.1%}",
            f"{prediction.allreduce_time * 1e3:.2f}", f"{1 / prediction.slowdown:.2f}",
        )  # fmt: skip
        lines.append("".join(str(v).rjust(width) for v, (_, width) in zip(values, COLUMNS)))
    unit = "one rank (plain model.fit)" if args.baseline == "rank" else "one node, same layout"
    lines.append(f"speed-up and efficiency relative to {unit}")
    return "\n".join(lines)


def _network_line(network: Network, machine: Machine) -> str:
    def describe(link):
        return f"{link.latency * 1e6:.2f} us, {link.bandwidth / 1e9:.2f} GB/s"

    parts = [f"intra-node {describe(network.intra)}"]
    if network.inter is not None:
        parts.append(f"inter-node {describe(network.inter)}")
    if not math.isinf(network.reduce_rate):
        parts.append(f"reduction {network.reduce_rate / 1e9:.2f} GB/s")
    parts.append(f"{network.overhead * 1e6:.1f} us per message")
    cores = machine.cores_per_node or "unlimited"
    return "Network: " + "; ".join(parts) + f". Cores per node: {cores}"


def _costs(args) -> ModelCosts:
    if args.source.endswith(".json"):
        return ModelCosts.load(args.source)
    import keras

    from hyparflow.simulate.measure import measure_model

    if len(args.profile_batch_sizes) != 2:
        raise ValueError("--profile-batch-sizes takes two sizes, e.g. 16,64")
    model = keras.saving.load_model(args.source)
    if getattr(model, "optimizer", None) is None:
        raise ValueError(f"{args.source} was saved without compiling; compile it, then save")
    costs = measure_model(
        model, batch_sizes=tuple(args.profile_batch_sizes), input_shape=args.input_shape
    )
    if args.save_costs:
        costs.save(args.save_costs)
    return costs


def _network(args) -> Network:
    if args.network:
        with open(args.network) as f:
            network = Network.from_dict(json.load(f))
    elif args.measure_network:
        from hyparflow.simulate.netbench import launch

        with tempfile.TemporaryDirectory() as folder:
            network = Network.from_dict(launch(os.path.join(folder, "network.json")))
    elif args.latency is not None and args.bandwidth is not None:
        network = Network(intra=Link(args.latency, args.bandwidth))
    else:
        raise ValueError(
            "give a network: --latency and --bandwidth (e.g. --latency 2e-6 --bandwidth 12e9), "
            "--network FILE, or --measure-network"
        )
    if args.latency is not None and args.bandwidth is not None:
        network = _replace(network, inter=Link(args.latency, args.bandwidth))
    if args.intra_latency is not None or args.intra_bandwidth is not None:
        intra = Link(
            network.intra.latency if args.intra_latency is None else args.intra_latency,
            network.intra.bandwidth if args.intra_bandwidth is None else args.intra_bandwidth,
        )
        network = _replace(network, intra=intra)
    if args.save_network:
        with open(args.save_network, "w") as f:
            json.dump(network.to_dict(), f, indent=1)
    return network


def _replace(network: Network, **changes) -> Network:
    from dataclasses import replace

    return replace(network, **changes)


def _layout(args, partitions: int, replicas: int) -> Layout:
    world = partitions * replicas
    per_node = args.ranks_per_node
    if per_node is None and args.nodes:
        per_node = math.ceil(world / args.nodes)
    return Layout(
        partitions=partitions,
        replicas=replicas,
        microbatches=args.microbatches if partitions > 1 else 1,
        schedule=args.schedule,
        ranks_per_node=per_node,
    )


def _baseline(args, costs, network, machine, layout: Layout) -> Prediction:
    if args.baseline == "rank":
        return predict(
            costs, network, Layout(), args.batch_size, machine, batch_logs=args.batch_logs
        )
    per_node = layout.ranks_per_node or layout.world
    replicas = max(1, per_node // layout.partitions)
    one_node = Layout(layout.partitions, replicas, layout.microbatches, layout.schedule, per_node)
    batch = args.batch_size * one_node.world // layout.world  # same batch per rank
    return predict(costs, network, one_node, batch, machine, batch_logs=args.batch_logs)


def _row_dict(prediction: Prediction, baseline: Prediction) -> dict:
    return {
        **prediction.to_dict(),
        "speedup": speedup(prediction, baseline),
        "efficiency": efficiency(prediction, baseline),
        "baseline_throughput": baseline.throughput,
    }


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _shape(text: str) -> tuple:
    return tuple(None if d.strip() in ("", "None") else int(d) for d in text.split(","))

"""`hyparflow simulate`: costs and network from the command line to a table of predictions."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
from dataclasses import replace

from hyparflow.partitioner.source import CUSTOM_OBJECTS_HELP, load_model
from hyparflow.simulate.costs import ModelCosts
from hyparflow.simulate.netbench import launch
from hyparflow.simulate.network import Link, Network
from hyparflow.simulate.placement import Layout
from hyparflow.simulate.predict import Machine, Prediction, efficiency, predict, speedup

COLUMNS = (
    ("P", 3),
    ("R", 4),
    ("M", 3),
    ("ranks", 6),
    ("nodes", 6),
    ("step ms", 10),
    ("samples/s", 11),
    ("speed-up", 9),
    ("efficiency", 11),
    ("bubble", 7),
    ("allreduce ms", 13),
)


def add_arguments(parser, hidden=frozenset(), network_title=None) -> None:
    """The `simulate` subcommand's options; those whose destination is in `hidden` are taken
    but left out of the help (`plan --auto` fixes the layout itself); `network_title` replaces
    the network group's (`plan --auto` measures one when none is given)."""

    def add(*flags, **options):
        action = parser.add_argument(*flags, **options)
        if action.dest in hidden:
            action.help = argparse.SUPPRESS

    # fmt: off
    add("source", help="a saved Keras model (.keras: its layers are timed here), module:function "
        "that builds a compiled one, or a costs file (.json, from --save-costs)")
    add("--batch-size", "--batch", type=int, required=True, help="global batch per step")
    add("--partitions", "-p", type=_ints, default=[1], help='e.g. "1,2,4"')
    add("--replicas", "-r", type=_ints, default=[1], help='e.g. "1,2,4"')
    add("--microbatches", "-m", type=int, default=1, help="per step, for pipelines (P > 1)")
    add("--schedule", default="1f1b", choices=("1f1b", "gpipe", "zero_bubble", "interleaved"))
    add("--virtual-stages", "-v", type=int, default=2, help="chunks per stage, if interleaved")
    add("--nodes", type=int, help="spread each layout over this many nodes")
    add("--ranks-per-node", type=int, help="ranks on each node (fills nodes)")
    add("--cores-per-node", type=int, help="cores of a node (default: those of the machine the "
        "costs were measured on); layouts with more ranks than cores on a node are skipped")
    add("--jitter", type=float, default=0.0, help="coefficient of variation of a rank's "
        "compute per step (e.g. 0.02): replicas wait for the slowest at their allreduce")
    add("--baseline", choices=("rank", "node"), default="rank",
        help="speed-up over one rank (default) or over the same layout on one node")
    add("--batch-logs", action="store_true", help="callbacks read every batch's logs "
        "(verbose=1, ScalingProfiler): the loop shares them after each step")
    add("--json", action="store_true", help="print the predictions as JSON")
    net = parser.add_argument_group(
        network_title
        or "network (Hockney alpha-beta links; one is required: --latency with --bandwidth, "
        "--network FILE or --measure-network)"
    ).add_argument
    net("--latency", type=float, help="inter-node latency in seconds, e.g. 2e-6")
    net("--bandwidth", type=float, help="inter-node bytes/s, e.g. 12e9")
    net("--intra-latency", type=float, help="intra-node latency in seconds")
    net("--intra-bandwidth", type=float, help="intra-node bytes/s")
    net("--network", help="a network file written by --save-network")
    net("--measure-network", action="store_true",
        help="measure the intra-node link and hyparflow's message costs here (mpirun, 2 ranks)")
    net("--save-network", help="write the network used to this JSON file")
    model = parser.add_argument_group("measuring a .keras model").add_argument
    model("--custom-objects", metavar="MODULE", help=CUSTOM_OBJECTS_HELP)
    model("--save-costs", help="write the measured costs to this JSON file")
    model("--profile-batch-sizes", type=_ints, default=[16, 64],
          help="two batch sizes to time the layers at (default 16,64; plan --auto: "
          "a quarter of one rank's share of the batch, and all of it)")
    model("--input-shape", type=_shape, help='e.g. "32,32,3" (unknown dimensions)')
    # fmt: on


def run(args) -> int:
    """Resolve costs and network, predict every (P, R), print the table."""
    try:
        (costs, _), network = costs_of(args), network_of(args)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"hyparflow simulate: {error}", file=sys.stderr)
        return 1
    machine = Machine(args.cores_per_node or costs.measured.get("cores"), args.jitter)

    def step(layout: Layout, batch: int) -> Prediction:
        return predict(costs, network, layout, batch, machine, batch_logs=args.batch_logs)

    rows, skipped = [], []
    for partitions, replicas in itertools.product(args.partitions, args.replicas):
        layout = _layout(args, partitions, replicas)
        try:
            rows.append((step(layout, args.batch_size), step(*_baseline(args, layout))))
        except ValueError as error:
            skipped.append(f"{partitions}x{replicas}: {error}")
    if args.json:
        print(
            json.dumps(
                [
                    {
                        **p.to_dict(),
                        "speedup": speedup(p, b),
                        "efficiency": efficiency(p, b),
                        "baseline_throughput": b.throughput,
                    }
                    for p, b in rows
                ],
                indent=1,
            )
        )
    else:
        print(table(costs, network, machine, args, rows))
    for reason in skipped:
        print(f"skipped {reason}", file=sys.stderr)
    return 0 if rows else 1


def table(costs, network, machine, args, rows) -> str:
    """The printed result: a header on the inputs, one row per layout."""
    lines = [
        f"Scaling model for {costs.name}: global batch {args.batch_size}, "
        f"{_schedule_name(args)} schedule, {len(costs.layers)} layers, "
        f"{costs.param_bytes / 2**20:.1f} MiB of gradients",
        _network_line(network, machine),
        "".join(name.rjust(width) for name, width in COLUMNS),
    ]
    for prediction, base in rows:
        layout = prediction.layout
        values = (
            layout.partitions,
            layout.replicas,
            layout.microbatches,
            layout.world,
            prediction.layout.nodes,
            f"{prediction.step_time * 1e3:.2f}",
            f"{prediction.throughput:,.0f}",
            f"{speedup(prediction, base):.2f}",
            f"{efficiency(prediction, base):.1%}",
            f"{prediction.bubble:.1%}",
            f"{prediction.allreduce_time * 1e3:.2f}",
        )
        lines.append("".join(str(v).rjust(w) for v, (_, w) in zip(values, COLUMNS, strict=True)))
    unit = "one rank (plain model.fit)" if args.baseline == "rank" else "one node, same layout"
    lines.append(f"speed-up and efficiency relative to {unit}")
    return "\n".join(lines)


def _network_line(network: Network, machine: Machine) -> str:
    links = [("intra", network.intra), ("inter", network.inter)]
    parts = [
        f"{where}-node {link.latency * 1e6:.2f} us, {link.bandwidth / 1e9:.2f} GB/s"
        for where, link in links
        if link is not None
    ]
    if not math.isinf(network.reduce_rate):
        parts.append(f"reduction {network.reduce_rate / 1e9:.2f} GB/s")
    return f"Network: {'; '.join(parts)}. Cores per node: {machine.cores_per_node or 'unlimited'}"


def costs_of(args) -> tuple[ModelCosts, object]:  # and the model timed (None: a costs file)
    if args.source.endswith(".json"):
        return ModelCosts.load(args.source), None
    from hyparflow.simulate.measure import measure_model  # imports Keras: only now

    model = load_model(args.source, args.custom_objects)
    return model_costs(model, args, measure_model), model


def model_costs(model, args, measure) -> ModelCosts:
    """`measure(model, batch_sizes, input_shape)` at `--profile-batch-sizes` and
    `--input-shape`, saved to `--save-costs` if given; the model must be compiled."""
    if len(args.profile_batch_sizes) != 2:
        raise ValueError("--profile-batch-sizes takes two sizes, e.g. 16,64")
    if getattr(model, "optimizer", None) is None:
        raise ValueError(f"{args.source} was saved without compiling; compile it, then save")
    costs = measure(model, tuple(args.profile_batch_sizes), args.input_shape)
    if args.save_costs:
        costs.save(args.save_costs)
    return costs


def network_of(args) -> Network:
    if args.network:
        with open(args.network) as f:
            network = Network.from_dict(json.load(f))
    elif args.measure_network:
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
        network = replace(network, inter=Link(args.latency, args.bandwidth))
    if args.intra_latency is not None or args.intra_bandwidth is not None:
        intra = Link(
            network.intra.latency if args.intra_latency is None else args.intra_latency,
            network.intra.bandwidth if args.intra_bandwidth is None else args.intra_bandwidth,
        )
        network = replace(network, intra=intra)
    if args.save_network:
        with open(args.save_network, "w") as f:
            json.dump(network.to_dict(), f, indent=1)
    return network


def _layout(args, partitions: int, replicas: int) -> Layout:
    world = partitions * replicas
    per_node = args.ranks_per_node
    if per_node is None and args.nodes:
        per_node = math.ceil(world / args.nodes)
    micro = args.microbatches if partitions > 1 else 1
    return Layout(partitions, replicas, micro, args.schedule, per_node, args.virtual_stages)


def _schedule_name(args) -> str:
    interleaved = args.schedule == "interleaved"
    return f"{args.schedule} (v={args.virtual_stages})" if interleaved else args.schedule


def _baseline(args, layout: Layout) -> tuple[Layout, int]:
    """What speed-ups are relative to: one rank, or the same layout on one node at the same
    batch per rank."""
    if args.baseline == "rank":
        return Layout(), args.batch_size
    per_node = layout.per_node
    replicas = max(1, per_node // layout.partitions)
    one_node = replace(layout, replicas=replicas, ranks_per_node=per_node)
    return one_node, args.batch_size * one_node.world // layout.world


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _shape(text: str) -> tuple:
    return tuple(None if d.strip() in ("", "None") else int(d) for d in text.split(","))

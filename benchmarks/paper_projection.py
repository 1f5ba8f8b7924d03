"""Where hyparflow would land on the HyPar-Flow paper's ResNet-1001 runs (110x on 128 Stampede2
nodes, 481x on 512 Frontera nodes, speed-up over one node), by the scaling model.

Run: .venv/bin/python benchmarks/paper_projection.py [--remeasure]

Every assumption is an argument or a constant here, and docs/simulate.md lists them: ResNet-1001
for CIFAR-10 (He et al., ECCV 2016) costed from a unit cell measured on this machine
(`hyparflow.simulate.measure`, one thread; cached in benchmarks/resnet1001_cell_costs.json)
whose regular blocks are repeated to 111 per stage, times `--compute-scale` for the paper's
cores (nominal AVX-512 FP32 peak per core: 1.5 for Stampede2, 1.25 for Frontera); one rank per
core, 1F1B, 8 samples per core and step (weak scaling) in three per-node layouts; an
inter-node link of 1.5 us and 12 GB/s (100 Gb/s fabrics), 0.5 us and 10 GB/s inside a node,
the reduction arithmetic as measured here (`netbench`, cached in benchmarks/network_here.json).
Speed-up = throughput on N nodes / throughput of the same layout on one node.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

CELL_COSTS = REPO / "benchmarks" / "resnet1001_cell_costs.json"
NETWORK_HERE = REPO / "benchmarks" / "network_here.json"
SAMPLES_PER_CORE = 8
BLOCKS_PER_STAGE = 111  # depth 9 x 111 + 2 = 1001
PAPER = {"Stampede2": (128, 110.0, 48, 1.5), "Frontera": (512, 481.0, 56, 1.25)}


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remeasure", action="store_true", help="time the cell and network again")
    parser.add_argument("--latency", type=float, default=1.5e-6, help="inter-node seconds")
    parser.add_argument("--bandwidth", type=float, default=12e9, help="inter-node bytes/s")
    parser.add_argument("--intra-latency", type=float, default=0.5e-6)
    parser.add_argument("--intra-bandwidth", type=float, default=10e9)
    parser.add_argument("--compute-scale", type=float, help="both systems' core slowdown vs here")
    parser.add_argument("--json", help="also write the tables to this JSON file")
    parser.add_argument(
        "--save-inputs",
        metavar="DIR",
        help="write each system's ResNet-1001 costs and network there, for hyparflow plan --auto",
    )
    parser.add_argument("--measure-cell", metavar="OUT", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def cell_model():
    """ResNet-1001's unit cell, ResNet-20 with bottlenecks: per stage a projection block and a
    regular one, whose layer names (s1b1_conv2) let it be repeated."""
    from benchmarks.models import cifar_resnet

    return cifar_resnet(20, bottleneck=True)


def expand_to_resnet1001(cell, blocks: int = BLOCKS_PER_STAGE):
    """ResNet-1001's costs from its cell's: each stage's regular block (`s<k>b1_*`) repeated
    `blocks - 1` times, its cut sizes with it."""
    from hyparflow.simulate import ModelCosts

    layers, cuts, n, i = [], [], len(cell.layers), 0
    while i < n:
        name = cell.layers[i].name
        stage_block = name.split("_")[0]
        if len(stage_block) == 4 and stage_block[0] == "s" and stage_block[2:] == "b1":
            end = i
            while end < n and cell.layers[end].name.startswith(stage_block + "_"):
                end += 1
            for copy in range(1, blocks):
                for j in range(i, end):
                    layer = cell.layers[j]
                    renamed = layer.name.replace(stage_block, f"{stage_block[:2]}b{copy}", 1)
                    layers.append(dataclasses.replace(layer, name=renamed))
                    cuts.append(cell.cut_bytes[j])
            i = end
        else:
            layers.append(cell.layers[i])
            cuts.append(cell.cut_bytes[i])
            i += 1
    cuts.append(0.0)
    return ModelCosts("resnet1001", layers, cuts, cell.engine, None, dict(cell.measured))


def load_network_here(remeasure: bool) -> dict:
    if remeasure or not NETWORK_HERE.exists():
        from hyparflow.simulate.netbench import launch

        launch(str(NETWORK_HERE))
    return json.loads(NETWORK_HERE.read_text())


def load_cell(remeasure: bool):
    from hyparflow.simulate import ModelCosts

    if remeasure or not CELL_COSTS.exists():
        env = {
            **os.environ,
            "TF_NUM_INTRAOP_THREADS": "1",
            "TF_NUM_INTEROP_THREADS": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONPATH": str(REPO),
        }
        command = [sys.executable, __file__, "--measure-cell", str(CELL_COSTS)]
        subprocess.run(["taskset", "-c", "0", *command], env=env, check=True)
    return ModelCosts.load(CELL_COSTS)


def layouts(cores: int) -> dict:
    """The per-node layouts compared: name -> (partitions, replicas per node, micro-batches)."""
    return {
        "pipeline per node": (cores, 1, 64),
        f"hybrid 8 x {cores // 8}": (8, cores // 8, 16),
        "data parallel": (1, cores, 1),
    }


def project(costs, network, cores: int, shape, nodes_list, per_core=SAMPLES_PER_CORE, jitter=0.0):
    """Weak scaling of one per-node layout over `nodes_list` nodes."""
    from hyparflow.simulate import Layout, Machine, predict

    partitions, replicas_per_node, microbatches = shape
    machine = Machine(cores_per_node=cores, jitter=jitter)
    rows, base = [], None
    for nodes in nodes_list:
        layout = Layout(
            partitions, replicas_per_node * nodes, microbatches, "1f1b", ranks_per_node=cores
        )
        p = predict(costs, network, layout, per_core * cores * nodes, machine)
        base = base or p
        speedup = p.throughput / base.throughput
        rows.append(
            {
                "nodes": nodes,
                "ranks": layout.world,
                "step_s": p.step_time,
                "allreduce_ms": p.allreduce_time * 1e3,
                "bubble": p.bubble,
                "throughput": p.throughput,
                "speedup": speedup,
                "efficiency": speedup / nodes,
            }
        )
    return rows


def main(argv=None) -> None:
    args = _arguments(argv)
    if args.measure_cell:
        from hyparflow.simulate.measure import measure_model

        measure_model(cell_model(), batch_sizes=(4, 16)).save(args.measure_cell)
        return
    cell = load_cell(args.remeasure)
    here = load_network_here(args.remeasure)
    resnet = expand_to_resnet1001(cell)
    dates = cell.measured.get("date", "?"), here["source"].get("date", "?")
    print(
        f"ResNet-1001: {len(resnet.layers)} layer calls, "
        f"{resnet.param_bytes / 4 / 1e6:.2f} M parameters; unit cell measured {dates[0]}, "
        f"network here {dates[1]}"
    )
    report = {"assumptions": vars(args), "systems": {}}
    for system, row in PAPER.items():
        report["systems"][system] = _project_system(args, resnet, here, system, *row)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def _project_system(args, resnet, here, system, nodes, paper, cores, default_scale) -> dict:
    """One system's projection: printed as a table, and its report entry."""
    from hyparflow.simulate import Link, Network

    factor = args.compute_scale or default_scale
    costs = resnet.scaled(factor)
    network = Network(
        intra=Link(args.intra_latency, args.intra_bandwidth),
        inter=Link(args.latency, args.bandwidth),
        reduce_rate=(here["reduce_rate"] or float("inf")) / factor,
    )
    save_inputs(args.save_inputs, system.lower(), costs, network)
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if n <= nodes]
    entry = {
        "paper_speedup": paper,
        "nodes": nodes,
        "cores": cores,
        "compute_scale": factor,
        "layouts": {},
    }
    print(
        f"\n{system}: {cores} cores per node, one rank per core, "
        f"{SAMPLES_PER_CORE * cores} samples per node and step; cores {factor}x slower "
        f"than here; paper: {paper:.0f}x on {nodes} nodes ({paper / nodes:.0%})"
    )
    print(
        f"{'layout':>22} {'P':>3} {'R/node':>6} {'M':>3} {'1-node step s':>14} "
        + " ".join(f"{n:>6}" for n in counts[1:])
    )
    for name, shape in layouts(cores).items():
        rows = project(costs, network, cores, shape, counts)
        entry["layouts"][name] = {"shape": shape, "rows": rows}
        _print_layout(name, shape, rows, nodes, paper)
    entry["sensitivity"] = sensitivity(costs, network, cores, nodes)
    return entry


def _print_layout(name: str, shape, rows: list, nodes: int, paper: float) -> None:
    """A layout's row of projected speedups, and what the paper's figure would need."""
    speedups = " ".join(f"{r['speedup']:>6.1f}" for r in rows[1:])
    print(
        f"{name:>22} {shape[0]:>3} {shape[1]:>6} {shape[2]:>3} "
        f"{rows[0]['step_s']:>14.3f} {speedups}"
    )
    last = rows[-1]
    extra = last["step_s"] * (last["speedup"] / paper - 1)
    print(
        f"{'':>22} -> {last['speedup']:.0f}x on {nodes} nodes "
        f"({last['efficiency']:.1%}); allreduce {last['allreduce_ms']:.1f} ms of a "
        f"{last['step_s'] * 1e3:.0f} ms step; the paper's {paper:.0f}x would need "
        f"{extra * 1e3:+.0f} ms per step more"
    )


def save_inputs(folder: str, system: str, costs, network) -> None:
    """`<system>_costs.json` and `<system>_network.json` in `folder` (None: nothing)."""
    if folder is None:
        return
    os.makedirs(folder, exist_ok=True)
    costs.save(os.path.join(folder, f"{system}_costs.json"))
    Path(folder, f"{system}_network.json").write_text(json.dumps(network.to_dict(), indent=1))


def sensitivity(costs, network, cores: int, nodes: int) -> dict:
    """Speed-up of the pipeline-per-node layout on `nodes` nodes when one assumption moves."""

    def moved(**change):  # the inter-node link with one assumption changed
        return dataclasses.replace(network, inter=dataclasses.replace(network.inter, **change))

    variants = {
        "as above": (network, SAMPLES_PER_CORE, 0.0),
        "10x less bandwidth (1.2 GB/s)": (moved(bandwidth=1.2e9), SAMPLES_PER_CORE, 0.0),
        "10x more latency (15 us)": (moved(latency=15e-6), SAMPLES_PER_CORE, 0.0),
        "1 sample per core, 8 micro-batches": (network, 1, 0.0),
        "jitter 1% per rank and step": (network, SAMPLES_PER_CORE, 0.01),
        "jitter 2%": (network, SAMPLES_PER_CORE, 0.02),
        "jitter 5%": (network, SAMPLES_PER_CORE, 0.05),
    }
    results = {}
    print(f"{'':>22} sensitivity on {nodes} nodes (pipeline per node):")
    for name, (net, per_core, jitter) in variants.items():
        shape = (cores, 1, 64 if per_core == SAMPLES_PER_CORE else 8)
        rows = project(costs, net, cores, shape, [1, nodes], per_core, jitter)
        results[name] = rows[-1]["speedup"]
        print(f"{'':>24}{name:<40} {rows[-1]['speedup']:>6.1f}x ({rows[-1]['efficiency']:.1%})")
    return results


if __name__ == "__main__":
    main()

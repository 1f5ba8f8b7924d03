"""Run the benchmark suite and write benchmarks/results.md and benchmarks/plots/ (`make bench`).

Run: .venv/bin/python benchmarks/run_all.py [--only p2p allreduce ...] [--skip-others]
     [--others-only] [--quick] [--record SCRIPT OUTPUT NOTE]

Every figure script is run in turn (each launches its own `mpirun` and workers); before each,
the driver waits for a quiet machine and records the load it saw. Records are kept per figure
in benchmarks/results.json, so `--only` reruns some figures and rewrites the whole report.
The other benchmarks of this folder, which print text, are run too and their output is
appended to the report (`--skip-others` leaves them out; their last output is kept).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import launch, machine, quiet  # noqa: E402
from benchmarks.harness.report import write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
FIGURES = {  # report order: key -> module and its arguments
    "overhead": "one_rank_overhead",
    "p2p": "p2p_bandwidth",
    "allreduce": "gradient_reduction",
    "data_parallel": "data_parallel",
    "pipeline": "pipeline_bubble",
    "resnet": "resnet_paper",
    "memory": "memory",
    "tensor": "tensor_parallel",
    "overlap": "engine_options --option overlap",
    "recompute": "engine_options --option recompute",
    "precision": "engine_options --option precision",
    "auto": "auto_choice",
    "moe": "moe_dispatch",
    "sharding": "sharding --models transformer mlp",
    "sharding_subclassed": "sharding --models subclassed --microbatches 1",
    "sharded_memory": "sharded_memory",
    "sharded_memory_transformer": (
        "sharded_memory --model transformer --layouts 1,1,1 1,4,1,zero3,scope 1,4,1,zero3"
    ),
    "planning": "planning_cost",
}
# Text-printing benchmarks: (title, script, venv, ranks, arguments).
OTHERS = [
    (
        "Dropout: global-batch masks sliced vs a mask per piece",
        "real_model_costs.py",
        "main",
        1,
        [],
    ),
    (
        "Embedding tables: gathered rows vs a dense allreduce",
        "real_model_costs.py",
        "main",
        2,
        ["--tables"],
    ),
    ("Scaling model vs measured runs, a core per rank", "simulator_validation.py", "main", 1, []),
    (
        "Scaling model: the paper's runs projected",
        "paper_projection.py",
        "main",
        1,
        ["--json", "benchmarks/out/paper_projection.json"],
    ),
]


def about(module) -> str:
    """The module docstring without its title line and its `Run:` paragraph."""
    paragraphs = (module.__doc__ or "").strip().split("\n\n")[1:]
    return "\n\n".join(p for p in paragraphs if not p.lstrip().startswith("Run:"))


def run_figure(key: str, quick: bool, wait: bool) -> dict:
    name, *argv = FIGURES[key].split()
    module = importlib.import_module(f"benchmarks.{name}")
    args = module.arguments(argv + (["--quick"] if quick else []))
    seen = quiet.wait_for_quiet() if wait else {"load1": os.getloadavg()[0]}
    start = time.monotonic()
    records = module.run(args)
    conditions = {
        "measured": datetime.datetime.now().strftime("%Y-%m-%d %H:%M UTC"),
        "load before": f"{seen['load1']:.2f}",
        "load after": f"{os.getloadavg()[0]:.2f}",
        "minutes": f"{(time.monotonic() - start) / 60:.1f}",
    }
    title = getattr(args, "title", None) or module.TITLE
    return {
        "figure": key,
        "title": title,
        "about": about(module),
        "records": records,
        "conditions": conditions,
    }


def run_other(title: str, script: str, venv: str, ranks: int, args: list, wait: bool):
    """Run a text-printing benchmark: its heading and stdout."""
    path = HERE / script
    seen = quiet.wait_for_quiet() if wait else {"load1": os.getloadavg()[0]}
    command = [launch.python_for(venv), str(path), *args]
    if ranks > 1:
        command = launch.mpirun_command(ranks, command)
    env = {**os.environ, **launch.MPI_ENV, **launch.thread_env()}
    os.makedirs(HERE / "out", exist_ok=True)
    result = subprocess.run(
        command, cwd=launch.REPO, env=env, capture_output=True, text=True, timeout=7200
    )
    text = result.stdout if result.returncode == 0 else result.stdout + result.stderr[-3000:]
    status = "" if result.returncode == 0 else f" (failed, exit {result.returncode})"
    heading = f"{title}: `{script}`{status}, load before {seen['load1']:.2f}"
    return heading, text


def describe_machine(previous: dict) -> dict:
    """This machine and each venv's versions; a venv absent now keeps its last description."""
    pythons = {"main": launch.python_for("main")}
    if launch.has_horovod():
        pythons["compat"] = launch.python_for("compat")
    described = machine.describe(pythons)
    described["venvs"] = {**previous.get("venvs", {}), **described["venvs"]}
    return described


def record_other(store: dict, script: str, output: str, note: str) -> None:
    """Store a text benchmark's output, run by hand, as its appendix (in `OTHERS` order)."""
    order = [other[1] for other in OTHERS]
    script = os.path.basename(script)
    if script not in order:
        raise SystemExit(f"--record: {script} is not one of the text benchmarks {order}")
    title = OTHERS[order.index(script)][0]
    with open(output) as f:
        entry = [f"{title}: `{script}` ({note})", f.read()]
    kept = [o for o in store.get("others", []) if f"`{script}`" not in o[0]]

    def place(other) -> int:  # an appendix's script, from its heading, in OTHERS order
        return next((i for i, name in enumerate(order) if f"`{name}`" in other[0]), len(order))

    store["others"] = sorted([*kept, entry], key=place)


def preamble(store: dict) -> str:
    loads = [float(f["conditions"]["load before"]) for f in store["figures"].values()]
    return f"""Generated by `make bench` (`benchmarks/run_all.py`); raw records in
`benchmarks/results.json`, plots in `benchmarks/plots/`. Each figure's script documents
exactly what it measures (its docstring is quoted under its heading).

How it was measured: every MPI rank runs with `TF_NUM_INTRAOP_THREADS={launch.INTRAOP_THREADS}`
and `TF_NUM_INTEROP_THREADS=1` (two ranks on two cores do not fight over cores; single-process
baselines are shown with 1 thread and with one thread per core); `mpirun --oversubscribe
--bind-to none` with `OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`. Medians over
repeats after warm-up; "range" is the lowest and highest repeat, "spread" half that range over
the median; A/B comparisons are interleaved (alternating order) and their ratios paired per
repeat. Before each figure the driver waited (up to 10 minutes) for a 1-minute load average
under 1.0 and under 15% of the cores busy (loads seen before the figures:
{min(loads, default=0):.2f} to {max(loads, default=0):.2f}; each figure lists its own). Until
2026-11-26 a launch was also repeated while other processes kept over 0.1 cores busy; the
conditions of figures measured then count those repeats. Rows with more ranks than cores
oversubscribe the machine and measure overheads, not scaling."""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(FIGURES), help="figures to rerun")
    parser.add_argument("--skip-others", action="store_true", help="only the figure scripts")
    parser.add_argument("--others-only", action="store_true", help="only the text benchmarks")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1-2 repeats")
    parser.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    parser.add_argument(
        "--record",
        nargs=3,
        metavar=("SCRIPT", "OUTPUT", "NOTE"),
        help="store the OUTPUT of SCRIPT run by hand as its appendix, NOTE in "
        "its heading, and rewrite the report; runs nothing",
    )
    parser.add_argument("--results", default=str(HERE / "results.md"))
    parser.add_argument("--json", default=str(HERE / "results.json"))
    parser.add_argument("--plots", default=str(HERE / "plots"))
    args = parser.parse_args(argv)
    store = {"figures": {}, "others": []}
    if os.path.exists(args.json):
        with open(args.json) as f:
            store = json.load(f)
    if args.record:
        record_other(store, *args.record)
        _save(store, args.json)
        write_report(store, args.results, args.plots)
        print(f"written: {args.results}")
        return
    wait = not args.no_wait
    for key in [] if args.others_only else args.only or FIGURES:
        print(f"== {key}", flush=True)
        store["figures"][key] = run_figure(key, args.quick, wait)
        _save(store, args.json)
    if args.others_only or not (args.skip_others or args.only):
        store["others"] = [run_other(*other, wait=wait) for other in OTHERS]
    store["machine"] = describe_machine(store.get("machine", {}))
    _save(store, args.json)
    write_report(store, args.results, args.plots)
    print(f"written: {args.results}")


def write_report(store: dict, results: str, plots: str) -> list[str]:
    figures = [store["figures"][key] for key in FIGURES if key in store["figures"]]
    scripts = [f"`{other[1]}`" for other in OTHERS]  # appendices of removed scripts are left out
    appendix = [o for o in store.get("others", []) if any(s in o[0] for s in scripts)]
    text = preamble(store) + (
        "\n\nConclusions drawn from earlier runs, and how the figures got here, are in "
        "[docs/notes/benchmarks.md](../docs/notes/benchmarks.md)."
    )
    return write_results(
        results, plots, store.get("machine", {}), figures, preamble=text, appendix=appendix
    )


def _save(store: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(store, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()

"""The benchmark suite's reporting code on fake records: statistics, targets, markdown, plots.

Pure: no MPI, no TensorFlow, no timing asserted. The benchmarks themselves run in `make bench`.
"""

import importlib.util
import json

import pytest

from benchmarks import run_all, simulator_validation
from benchmarks.harness import stats
from benchmarks.harness.records import emit, measurement, target
from benchmarks.harness.report import write_results

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_summary_and_paired_ratios():
    summary = stats.summarize([3.0, 1.0, 2.0, 10.0])
    assert summary["median"] == 2.5 and (summary["low"], summary["high"]) == (1.0, 10.0)
    assert summary["n"] == 4 and summary["spread"] == pytest.approx(9 / 5)
    assert stats.paired_ratios([2, 9], [1, 3]) == [2.0, 3.0]
    with pytest.raises(ValueError):
        stats.paired_ratios([1], [1, 2])
    with pytest.raises(ValueError):
        stats.summarize([])


@pytest.mark.parametrize(
    "goal, ratios, met",
    [
        ("<= 1.05", [1.0, 1.04], True),
        ("<= 1.05", [1.2, 1.3], False),
        (">= 0.9", [0.95], True),
        ("< 1.0", [1.0], False),
    ],
)
def test_target_met(goal, ratios, met):
    record = target("fig", "a / b", ratios, goal)
    assert record["met"] is met and record["kind"] == "target" and record["unit"] == "ratio"


def _figures():
    lines = [
        measurement("p2p", f"{way}, {size} MiB", [v, v * 1.1], "GB/s", series=way, x=size)
        for way in ("raw", "channel")
        for size, v in ((0.0625, 3.0), (1, 10.0), (64, 12.0))
    ]
    lines.append(target("p2p", "channel / raw, 64 MiB", [0.95, 0.97], ">= 0.9"))
    bars = [
        measurement("overhead", "model.fit", [1.0, 1.1, 0.9], "s", width=8),
        measurement("overhead", "hf.fit", [1.02, 1.0, 1.01], "s"),
        target("overhead", "engine / model.fit", [1.4, 1.5], "<= 1.05"),
    ]
    return [
        {
            "figure": "p2p",
            "title": "(2) P2P",
            "about": "Ping-pong.",
            "records": lines,
            "conditions": {"load before": "0.4"},
        },
        {"figure": "overhead", "records": bars},
    ]


def _check_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE


def test_results_markdown_and_plots(tmp_path):
    machine = {
        "cores": 2,
        "cpu": "Test CPU",
        "memory_gib": 4.0,
        "open_mpi": "4.1.4",
        "venvs": {"main": {"python": "3.11", "tensorflow": "2.21.0", "horovod": None}},
    }
    path = tmp_path / "results.md"
    plots = write_results(
        str(path),
        str(tmp_path / "plots"),
        machine,
        _figures(),
        preamble="Fake run.",
        appendix=[("Other", "printed text")],
    )
    text = path.read_text()
    assert text.startswith("# hyparflow benchmark results")
    assert "Fake run." in text and "Test CPU" in text and "| main | 3.11 | 2.21.0 |" in text
    assert "| p2p | channel / raw, 64 MiB | >= 0.9 | 0.960 |" in text and "**met**" in text
    assert "| overhead | engine / model.fit | <= 1.05 | 1.450 |" in text and "**missed**" in text
    assert "## (2) P2P" in text and "Ping-pong." in text and "load before 0.4" in text
    assert "| raw, 1 MiB | 10.5 |" in text
    assert "![p2p](plots/p2p.png)" in text and "![overhead](plots/overhead.png)" in text
    assert "## Other" in text and "printed text" in text
    assert sorted(p.rsplit("/", 1)[-1] for p in plots) == ["overhead.png", "p2p.png"]
    for plot in plots:
        _check_png(plot)


def test_emit_prints_and_writes(tmp_path, capsys):
    records = _figures()[1]["records"]
    out = tmp_path / "records.json"
    assert emit(records, str(out)) is records
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == records == json.loads(out.read_text())


def test_driver_report_from_stored_records(tmp_path):
    figures = {f["figure"]: {**f, "conditions": {"load before": "0.50"}} for f in _figures()}
    store = {
        "figures": figures,
        "others": [
            ["Dropout: `real_model_costs.py`", "3 stages"],
            ["Gone: `shared_cores_pipeline.py`", "a removed benchmark's last output"],
        ],
        "machine": {"cores": 2},
    }
    plots = run_all.write_report(store, str(tmp_path / "results.md"), str(tmp_path / "plots"))
    text = (tmp_path / "results.md").read_text()
    assert "TF_NUM_INTRAOP_THREADS=1" in text and "0.50 to 0.50" in text
    assert text.index("## overhead") < text.index("## (2) P2P")  # the driver's order
    assert "3 stages" in text and len(plots) == 2
    assert "removed benchmark" not in text  # only appendices of scripts that still exist
    assert "(../docs/notes/benchmarks.md)" in text


def test_driver_lists_only_existing_benchmarks():
    scripts = [other[1] for other in run_all.OTHERS]
    assert "simulator_validation.py" in scripts and "paper_projection.py" in scripts
    missing = [s for s in scripts if not (run_all.HERE / s).exists()]
    assert missing == []
    assert all(
        importlib.util.find_spec(f"benchmarks.{m.split()[0]}") for m in run_all.FIGURES.values()
    )


@pytest.mark.parametrize("key", list(run_all.FIGURES))
def test_every_figure_parses_its_quick_arguments(key):
    name, *argv = run_all.FIGURES[key].split()
    module = importlib.import_module(f"benchmarks.{name}")
    args = module.arguments([*argv, "--quick"])
    assert args.quick and (getattr(args, "title", None) or module.TITLE)
    # a figure timed under mpirun has a worker; one that runs commands of its own says None
    assert callable(module.run) and (module.worker is None or callable(module.worker))


@pytest.mark.parametrize("script", sorted({other[1] for other in run_all.OTHERS}))
def test_every_text_benchmark_parses_its_arguments(script):
    module = importlib.import_module(f"benchmarks.{script.removesuffix('.py')}")
    assert module._arguments([]) is not None


def test_engine_options_share_one_script_with_a_setup_each():
    from benchmarks import engine_options

    overlap = engine_options.arguments(["--option", "overlap"])
    assert (overlap.width, overlap.steps, overlap.microbatches) == (1024, 20, 8)
    recompute = engine_options.arguments(["--option", "recompute", "--quick"])
    assert (recompute.depth, recompute.batch_size, recompute.rounds) == (4, 512, 1)
    precision = engine_options.arguments(["--option", "precision", "--width", "256"])
    assert (precision.width, precision.epochs, precision.microbatches) == (256, 3, 4)
    assert len({a.title for a in (overlap, recompute, precision)}) == 3


def test_simulator_validation_covers_a_core_per_rank_only():
    assert simulator_validation.CONFIGS == [(1, 1), (1, 2), (2, 1)]
    arguments = simulator_validation._arguments([])
    assert max(p * r for p, r in simulator_validation.CONFIGS) <= 2 and arguments.rounds >= 1

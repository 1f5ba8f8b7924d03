"""`hyparflow plan --auto MODEL --measure`: the top layouts trained, predicted against measured."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from hyparflow import cli
from hyparflow.auto import command as auto_command
from hyparflow.auto import measure_launch, measure_worker
from hyparflow.auto.measure import Measured, entries, error_line, median_rate, table, top
from hyparflow.auto.search import Candidate, Estimate, search
from hyparflow.launch.command import Facts, Launch
from tests.support.cases import LAYOUT_FIELDS
from tests.support.doc_commands import commands
from tests.support.measure_models import save_uniform_costs
from tests.support.mpirun import LAUNCHES, MPI_ENV, REPO, sharing
from tests.support.mpirun import Launch as Launched

TINY = "tests.support.measure_models:tiny_mlp"
NETWORK = ["--latency", "2e-6", "--bandwidth", "12e9"]


def _result(budget=None):
    """Five layouts of 4 ranks: R4 fastest, then R2 x T2, P2 x R2, ...; P4 needs 4 GiB."""
    steps = {(1, 4, 1): 1.0, (1, 2, 2): 1.2, (2, 2, 1): 1.5, (1, 1, 4): 1.9, (4, 1, 1): 0.5}
    layouts = [Candidate(p, r, t) for p, r, t in steps]

    def estimate(c):
        return Estimate(
            steps[c.partitions, c.replicas, c.tensor], 4 << 30 if c.partitions == 4 else 1 << 30
        )

    return search(layouts, estimate, 64, budget_bytes=budget)


def test_the_top_layouts_are_the_fastest_that_fit_the_pick_first():
    result = _result(budget=2 << 30)  # the fastest of all, P4, is over the budget
    chosen = [v.candidate.label() for v in top(result)]
    assert chosen == ["P1 R4 T1 M1", "P1 R2 T2 M1", "P2 R2 T1 M1 gpipe"]
    assert chosen[0] == result.pick.candidate.label()
    assert "P4 R1 T1 M1 gpipe" in {v.candidate.label() for v in result.rejected}
    assert len(top(_result(budget=2 << 30), count=9)) == 4  # fewer fit than asked: all of them


def test_a_rate_is_the_median_step():
    assert median_rate(32, [0.1, 0.2, 5.0, 0.15]) == pytest.approx(32 / 0.175)


def _measured(rates=((48.0, None), (None, "ValueError: cannot split"), (51.2, None))):
    """The top three within 2 GiB (predicted 64, 53 and 43 samples/s), measured as `rates`."""
    result = _result(budget=2 << 30)
    return [
        Measured(v.candidate, result.samples_per_second(v), rate, error)
        for v, (rate, error) in zip(top(result), rates, strict=True)
    ]


def test_the_table_sets_measured_beside_predicted_and_names_the_fastest():
    lines = table(_measured(), steps=5).splitlines()
    assert lines[0].startswith("measured (5 steps each")
    assert lines[1].split() == ["layout", "predicted", "measured", "meas/pred"]
    assert lines[2].startswith("P1 R4 T1 M1") and lines[2].split()[-3:] == ["64", "48", "0.75"]
    assert lines[3].split()[-7:-4] == ["53", "-", "-"]
    assert lines[3].endswith("failed: ValueError: cannot split")
    assert lines[4].split()[-6:] == ["43", "51", "1.20", "<-", "fastest", "measured"]
    assert lines[5] == "P2 R2 T1 M1 gpipe measured fastest; the pick, P1 R4 T1 M1, 0.94x of it"
    alone = table(_measured(((48.0, None), (None, "x"), (None, "y"))), steps=5).splitlines()
    assert alone[2].endswith("<- fastest measured")
    assert alone[-1] == "the pick, P1 R4 T1 M1, measured fastest"
    failed = table(_measured(((None, "x"), (None, "y"), (9.0, None))), steps=5)
    assert failed.endswith("the pick, P1 R4 T1 M1, failed")
    nothing = table(_measured(((None, "x"),) * 3), steps=5)
    assert nothing.endswith("no layout could be measured") and "fastest measured" not in nothing


def test_json_entries_carry_the_layout_and_a_rate_or_an_error():
    found = entries(_measured())
    assert [e["label"] for e in found] == [m.candidate.label() for m in _measured()]
    assert found[0]["measured_samples_per_second"] == 48.0 and "error" not in found[0]
    assert found[0]["predicted_samples_per_second"] == 64.0
    assert found[1]["error"] == "ValueError: cannot split"
    assert "measured_samples_per_second" not in found[1]
    for entry in found:
        assert {*LAYOUT_FIELDS, "predicted_samples_per_second"} <= set(entry)


def test_the_error_line_is_the_exception_not_tensorflows_start_up_log():
    output = (
        "I0000 00:00:17.7 4578 port.cc:153] oneDNN custom operations are on\n"
        "Traceback (most recent call last):\n  File x\n"
        "ValueError: batch_size=32 does not split\n-----\nmpirun detected ...\n"
    )
    assert error_line(output) == "ValueError: batch_size=32 does not split"
    assert error_line("E0000 00:00:17.7 5520 cuda_platform.cc:52] failed call\n") == "no output"
    assert error_line("mpirun was unable to launch\n\n") == "mpirun was unable to launch"
    ranks = "hyparflow rank 1 failed: KeyError: 'a'; stopping the others\nValueError: later\n"
    assert error_line(ranks).startswith("hyparflow rank 1 failed: KeyError")


def test_a_jobs_outcome_from_its_status_output_and_file(tmp_path):
    out = str(tmp_path / "layout.json")
    assert measure_launch.outcome(None, "", out, 30) == ("timed out after 30 s", None)
    assert measure_launch.outcome(1, "", out, 30) == ("exit status 1", None)
    assert measure_launch.outcome(1, "KeyError: 'x'\n", out, 30) == ("KeyError: 'x'", None)
    with open(out, "w") as file:
        json.dump({"error": "ValueError: no"}, file)
    assert measure_launch.outcome(1, "Other: x", out, 30) == ("ValueError: no", None)
    with open(out, "w") as file:
        json.dump({"samples_per_second": 123.0, "step_seconds": [0.1]}, file)
    assert measure_launch.outcome(0, "", out, 30) == (None, 123.0)


def test_the_worker_trains_and_times_in_one_process_and_writes_its_errors(tmp_path):
    import hyparflow as hf

    out = str(tmp_path / "layout.json")
    argv = [
        "--strategy",
        json.dumps(Candidate().strategy_options()),
        "--batch",
        "8",
        "--steps",
        "3",
        "--out",
        out,
    ]
    assert measure_worker.main([TINY, *argv], fit=hf.fit) == 0  # one process: model.fit
    with open(out) as file:
        written = json.load(file)
    assert len(written["step_seconds"]) == 3 and all(s > 0 for s in written["step_seconds"])
    assert written["samples_per_second"] == median_rate(8, written["step_seconds"])
    with pytest.raises(ValueError, match="no_such_module"):
        measure_worker.main(["no_such_module:build", *argv], fit=hf.fit)
    with open(out) as file:
        assert json.load(file)["error"].startswith("ValueError: cannot import 'no_such_module'")


def test_synthetic_targets_are_what_the_loss_takes():
    import keras

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(4)(inputs))
    model.compile("sgd", "mse")  # indices would broadcast against one row, not a batch
    x, y = measure_worker._synthetic(model, 24, 8, None)
    assert x.shape == (24, 3) and y.shape == (24, 4)
    model.compile("sgd", "sparse_categorical_crossentropy")
    assert measure_worker._synthetic(model, 24, 8, None)[1].shape == (24,)


def _facts(cores=8, root=True, mpirun=True):
    return Facts(
        environ={},
        root=root,
        cores=cores,
        python="/usr/bin/python3",
        which=lambda tool: f"/usr/bin/{tool}" if mpirun and tool == "mpirun" else None,
        is_file=lambda path: False,
        read_text=lambda path: "",
    )


def _args(*extra):
    args = auto_command.plan_parser().parse_args(
        [TINY, "--auto", "--ranks", "4", "--batch", "64", *NETWORK, "--measure", *extra]
    )
    args.auto = args.ranks
    return args


def test_each_rank_runs_the_clis_worker_on_the_layouts_strategy():
    candidate = Candidate(2, 2, microbatches=4, schedule="1f1b")
    args = _args("--measure-steps", "7", "--custom-objects", "my.layers", "--input-shape", "3,")
    program = measure_launch.worker_program(candidate, args, "/tmp/out.json")
    assert program[:4] == ("-m", "hyparflow.cli", cli.MEASURE_WORKER, TINY)
    assert measure_worker.COMMAND == cli.MEASURE_WORKER
    worker = measure_worker._parser().parse_args(program[3:])
    assert json.loads(worker.strategy) == candidate.strategy_options()
    assert (worker.batch, worker.steps, worker.warmup) == (64, 7, measure_launch.WARMUP)
    assert (worker.custom_objects, worker.input_shape) == ("my.layers", [3, None])


def test_without_a_launcher_every_layout_reports_why_and_nothing_starts(monkeypatch):
    monkeypatch.setattr(measure_launch, "run_job", lambda *a: pytest.fail("started a job"))
    found = measure_launch.measure(_result(), _args(), _facts(mpirun=False), say=None)
    assert [m.candidate.label() for m in found] == [v.candidate.label() for v in top(_result())]
    assert all(m.measured is None and "mpirun" in m.error for m in found)


def test_the_job_is_hyparflow_runs_command_oversubscribed_past_the_cores(monkeypatch):
    jobs, said = [], []
    monkeypatch.setattr(
        measure_launch, "run_job", lambda launch, limit: jobs.append(launch) or (1, "")
    )
    measure_launch.measure(_result(), _args(), _facts(cores=2), say=said.append)
    assert len(jobs) == 3 and len(said) == 3 and said[0].startswith("measuring P4 R1 T1 M1 gpipe")
    argv = jobs[0].argv
    assert argv[:4] == ("mpirun", "-np", "4", "--oversubscribe")
    assert jobs[0].env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"  # for the child only (root here)
    assert "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" in argv and argv[-2] != "--oversubscribe"
    measure_launch.measure(_result(), _args(), _facts(cores=8, root=False), say=said.append)
    assert "--oversubscribe" not in jobs[-1].argv and "OMPI_ALLOW_RUN_AS_ROOT" not in jobs[-1].env


def test_a_job_past_its_limit_is_stopped_with_every_process_it_started():
    # SIGTERM ends the shell alone, as a killed mpirun would leave its ranks: found by session
    launch = Launch("mpirun", ("sh", "-c", "sleep 3607 & sleep 3607"))
    started = time.monotonic()
    status, _ = measure_launch.run_job(launch, timeout=0.5)
    assert status is None and time.monotonic() - started < measure_launch.STOP_GRACE
    time.sleep(0.1)
    assert not [pid for pid in _all_pids() if _runs(pid, b"sleep\x003607\x00")]


def _all_pids():
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _runs(pid: int, cmdline: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return cmdline in file.read()
    except OSError:  # ended meanwhile
        return False


def test_a_costs_file_has_nothing_to_train(tmp_path, capsys):
    path = str(tmp_path / "costs.json")
    save_uniform_costs(path)
    argv = ["plan", "--auto", path, "--ranks", "2", "--batch", "8", *NETWORK]
    assert cli.main([*argv, "--measure"]) == 1
    assert "--measure trains the model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*argv, "--measure", "--measure-steps", "0"])
    assert "at least 1 step" in capsys.readouterr().err


def test_the_report_and_json_gain_the_measured_layouts_and_keep_their_keys(tmp_path, capsys):
    path = str(tmp_path / "costs.json")
    save_uniform_costs(path)
    args = auto_command.plan_parser().parse_args(
        [path, "--auto", "--ranks", "2", "--batch", "8", *NETWORK, "--json"]
    )
    args.auto = args.ranks
    assert auto_command.run(args, memory_of=None) == 0
    plain = json.loads(capsys.readouterr().out)

    def fake(result):
        return [Measured(v.candidate, result.samples_per_second(v), 10.0) for v in top(result)]

    assert auto_command.run(args, memory_of=None, measure=fake) == 0
    found = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in found.items() if k != "measured"} == plain
    assert [m["label"] for m in found["measured"]] == [r["label"] for r in plain["ranked"][:3]]
    assert found["measured"][0]["label"] == plain["pick"]["label"]
    args.json = False
    assert auto_command.run(args, memory_of=None, measure=fake) == 0
    text = capsys.readouterr().out
    assert text.startswith("auto: ") and "\n\nmeasured (5 steps each" in text


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_plan_auto_measure_trains_the_top_layouts_on_two_ranks(request):
    """The real thing, as docs/auto.md writes it: the planner times a small MLP here, then one
    mpirun per top layout; the report's table has the pick first."""
    env = {**os.environ, **MPI_ENV}
    for name in (
        "OMPI_ALLOW_RUN_AS_ROOT",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
        "TF_NUM_INTRAOP_THREADS",
        "TF_NUM_INTEROP_THREADS",
        "OMP_NUM_THREADS",
    ):
        env.pop(name, None)  # the launch sets them for its ranks, as `hyparflow run` would
    (shown,) = [c for c in commands("auto.md", "hyparflow plan --auto") if "--measure" in c]
    argv = [os.path.join(os.path.dirname(sys.executable), "hyparflow"), *shown[1:]]
    # measured 35-41 s (2026-11-29, 2 cores); W pytest workers share the cores
    started, limit = time.monotonic(), 150 * sharing()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
    seconds = time.monotonic() - started
    LAUNCHES.append(Launched(request.node.nodeid, "plan --auto --measure", 2, seconds, limit))
    assert done.returncode == 0, done.stderr[-3000:]
    pick = re.match(r"auto: (P\d+ R\d+ T\d+ M\d+)", done.stdout).group(1)
    table = done.stdout.split("\nmeasured (5 steps each")[1].splitlines()[2:]
    rows = [line for line in table if re.match(r"P\d+ R\d+ T\d+ M\d+[\w ]*\s{2,}[\d,]+ ", line)]
    assert 2 <= len(rows) <= 3 and rows[0].startswith(pick + " "), done.stdout
    measured = [re.split(r"\s{2,}", row)[2] for row in rows]  # samples/s, or an error
    assert any(m.replace(",", "").isdigit() and int(m.replace(",", "")) > 0 for m in measured)
    assert done.stderr.count("measuring P") == len(rows)
    worker = f"{cli.MEASURE_WORKER}\x00{shown[3]}".encode()
    assert not [pid for pid in _all_pids() if _runs(pid, worker)]  # every rank ended

"""`plan --auto --measure`'s launch edge: one job per layout, as `hyparflow run` starts it.

Each of the planner's top layouts runs `measure_worker` on N ranks, with the command that
`hyparflow.launch.command.build` makes for `hyparflow run -n N` (mpirun here, srun inside a
Slurm allocation; `--oversubscribe` when N exceeds the cores). The job's variables (thread
pools, Open MPI's root switches) go to the child only. A job that fails, or outlives its limit,
becomes an error line in its row: the command goes on, and no process of the job is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile

from hyparflow.auto.measure import Measured, error_line, top
from hyparflow.auto.measure_worker import COMMAND
from hyparflow.launch.command import LaunchError, Options, build

WARMUP = 2  # untimed steps first: the first traces every compiled function
STOP_GRACE = 10  # seconds mpirun gets to end its ranks after SIGTERM


def measure(result, args, facts, say=print) -> list[Measured]:
    """Train each of `result`'s top layouts for `args.measure_steps` steps on `args.auto`
    ranks (`facts`: this machine's, as `hyparflow run` reads them); `say` reports progress."""
    chosen, found = top(result), []
    with tempfile.TemporaryDirectory(prefix="hf-measure-") as folder:
        for k, verdict in enumerate(chosen):
            out, place = os.path.join(folder, f"layout{k}.json"), f"{k + 1} of {len(chosen)}"
            error, rate = _run_layout(verdict.candidate, args, facts, out, say, place)
            predicted = result.samples_per_second(verdict)
            found.append(Measured(verdict.candidate, predicted, rate, error))
    return found


def _run_layout(candidate, args, facts, out: str, say, place: str) -> tuple:
    """(error, samples/s), one of them None, of `candidate`'s job."""
    program = worker_program(candidate, args, out)
    try:
        oversubscribe = args.auto > facts.cores
        launch = build(Options(program, ranks=args.auto, oversubscribe=oversubscribe), facts)
        say(f"measuring {candidate.label()} ({place}): {launch.line()}")
        status, output = run_job(launch, args.measure_timeout)
    except (LaunchError, OSError) as error:  # no launcher here, or it would not start
        return str(error), None
    return outcome(status, output, out, args.measure_timeout)


def worker_program(candidate, args, out: str) -> tuple[str, ...]:
    """What each rank runs: the CLI's worker on MODEL under `candidate`'s hf.Strategy."""
    program = [
        "-m", "hyparflow.cli", COMMAND, args.source,
        "--strategy", json.dumps(candidate.strategy_options()),
        "--batch",    str(args.batch_size),
        "--warmup",   str(WARMUP),
        "--steps",    str(args.measure_steps),
        "--out",      out,
    ]  # fmt: skip
    if args.custom_objects:
        program += ["--custom-objects", args.custom_objects]
    if args.input_shape is not None:
        program += ["--input-shape", json.dumps(list(args.input_shape))]
    return tuple(program)


def outcome(status: int | None, output: str, out: str, limit: float) -> tuple:
    """(error, samples/s), one of them None, of a job from its exit status (None: it outlived
    its `limit` of seconds), its output and the file rank 0 wrote at `out`."""
    written = {}
    if os.path.exists(out):
        with open(out) as file:
            written = json.load(file)
    if status == 0 and "samples_per_second" in written:
        return None, written["samples_per_second"]
    if "error" in written:
        return written["error"], None
    if status is None:
        return f"timed out after {limit:g} s", None
    return error_line(output) if output.strip() else f"exit status {status}", None


def run_job(launch, timeout: float) -> tuple[int | None, str]:
    """Run `launch` in a session of its own; its exit status (None if it outlived `timeout`
    seconds and was stopped) and its output. Whatever happens, none of its processes
    outlives this call."""
    env = {**os.environ, **launch.env}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up lines, on every rank
    process = subprocess.Popen(
        list(launch.argv),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a session of its own: its ranks can be found and ended
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        _stop(process)
        return None, _rest(process)
    except BaseException:  # Ctrl-C here: the job, in its own session, did not get it
        _stop(process)
        raise
    finally:
        _end_session(process.pid)


def _rest(process) -> str:
    """What a stopped job wrote last: read once its session is gone, which closes the pipe
    (a rank left running holds it open)."""
    _end_session(process.pid)
    try:
        return process.communicate(timeout=STOP_GRACE)[0]
    except subprocess.TimeoutExpired:
        return ""


def _stop(process) -> None:
    """SIGTERM, which mpirun passes to its ranks; SIGKILL for the whole session if it lingers."""
    process.terminate()
    try:
        process.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        _end_session(process.pid)
        process.kill()
        process.wait()


def _end_session(session: int) -> None:
    """SIGKILL every process left in `session` (ranks orphaned by a killed mpirun)."""
    for pid in session_members(session):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)


def session_members(session: int) -> list[int]:
    """The processes whose session is `session` (Linux's /proc; none found elsewhere)."""
    if not sys.platform.startswith("linux"):
        return []
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as file:
                fields = file.read().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == session:  # after the name: state, ppid, pgrp, session
            members.append(int(name))
    return members

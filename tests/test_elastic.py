"""Elastic restarts and preemption: `hyparflow run --max-restarts` relaunches a job on the hosts
that survive, and a SIGTERM checkpoints the current step (docs/reliability.md, docs/launch.md).

The pure decisions (which hosts, how many ranks, whether to relaunch) are table-tested here;
the jobs run under a real `hyparflow run` (real mpirun, emulated nodes whose launch agent
refuses a node once it is "down"), resume with `hf.fit(..., resume=True)` and end equal to
one-process Keras.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from hyparflow.launch import elastic
from hyparflow.launch.command import Facts, Launch, LaunchError, Options, build
from hyparflow.launch.earlier_lines import EarlierLaunches
from hyparflow.launch.preemption import PREEMPTED_STATUS, SignalFlag
from hyparflow.strategy import Strategy
from tests.support import nodes
from tests.support.mpirun import MPI_ENV, REPO

TOLERANCE = 1e-5
HOSTS = "nodeA:2,nodeB:2"


def _facts(environ=None, hostfile=""):
    return Facts(
        environ=environ or {},
        root=False,
        cores=4,
        python="/usr/bin/python3",
        which=lambda tool: f"/usr/bin/{tool}",
        is_file=lambda path: True,
        read_text=lambda path: hostfile,
    )


# --- the decisions (pure) -----------------------------------------------------------------------


def test_the_hosts_to_probe_come_from_the_hosts_the_hostfile_or_the_allocation():
    assert elastic.job_hosts(Options(("t.py",), 3, hosts="a:2,b"), _facts(), []) == [
        elastic.Host("a", 2),
        elastic.Host("b", 1),
    ]
    listed = elastic.job_hosts(
        Options(("t.py",), 8, hostfile="hosts"), _facts(hostfile="a slots=6\nb\n"), []
    )
    assert listed == [elastic.Host("a", 6), elastic.Host("b", 4)]  # b: this host's cores
    slurm = _facts({"SLURM_JOB_ID": "7", "SLURM_TASKS_PER_NODE": "2(x2),1"})
    assert elastic.job_hosts(Options(("t.py",)), slurm, ["n1", "n2", "n3"]) == [
        elastic.Host("n1", 2),
        elastic.Host("n2", 2),
        elastic.Host("n3", 1),
    ]
    assert elastic.job_hosts(Options(("t.py",), 2), _facts(), []) is None  # this machine


@pytest.mark.parametrize(
    ("status", "restarts", "signalled", "relaunch"),
    [
        (0, 0, False, False),  # done
        (PREEMPTED_STATUS, 0, False, False),  # the batch system requeues it, not us
        (137, 0, True, False),  # the user or the batch system stopped it
        (137, 0, False, True),
        (1, 1, False, True),
        (1, 2, False, False),  # K = 2 used up
    ],
)
def test_only_a_failure_with_restarts_left_is_relaunched(status, restarts, signalled, relaunch):
    reason = elastic.why_not_restart(status, restarts, 2, signalled)
    assert (reason is None) == relaunch, reason


def test_the_relaunch_uses_the_hosts_that_answer_with_the_ranks_they_hold():
    hosts = [elastic.Host("a", 2), elastic.Host("b", 2), elastic.Host("c", 2)]
    options = Options(("t.py",), 6, hosts="a:2,b:2,c:2")
    after = elastic.relaunched(options, hosts, {"a", "c"}, "mpirun", 1)
    assert (after.ranks, after.hosts) == (4, "a:2,c:2")
    fewer = Options(("t.py",), 3, hostfile="hosts")  # never more ranks than asked
    after = elastic.relaunched(fewer, hosts, {"a", "c"}, "mpirun", 1)
    assert (after.ranks, after.hosts, after.hostfile) == (3, "a:2,c:2", None)
    slurm = elastic.relaunched(Options(("t.py",)), hosts, {"b"}, "srun", 1)
    assert (slurm.ranks, slurm.hosts) == (2, "b")  # srun: node names, Slurm places the tasks
    with pytest.raises(LaunchError, match=r"2 rank\(s\) left .*a, c do\(es\) not.*--min-ranks 3"):
        elastic.relaunched(options, hosts, {"b"}, "mpirun", 3)
    alone = Options(("t.py",), 2)
    assert elastic.relaunched(alone, None, set(), "mpirun", 1) is alone


def test_probes_start_true_the_way_the_job_starts_its_ranks():
    agent = ("--mca", "plm_rsh_agent", "my-ssh")
    assert elastic.probe_argv("mpirun", "n1", agent) == [
        "mpirun",
        "-np",
        "1",
        "--host",
        "n1:1",
        *agent,
        "true",
    ]
    assert elastic.probe_argv("srun", "n1", ()) == [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=n1",
        "true",
    ]


def test_each_launch_tells_its_ranks_which_it_is():
    facts = _facts()
    first = build(Options(("t.py",), 2, restart=0), facts)
    assert first.env["HYPARFLOW_RESTART"] == "0"
    assert first.argv[first.argv.index("HYPARFLOW_RESTART") - 1] == "-x"  # to remote ranks
    assert "HYPARFLOW_RESTART" not in build(Options(("t.py",), 2), facts).env  # no restarts
    slurm = _facts({"SLURM_JOB_ID": "1", "SLURM_JOB_CPUS_PER_NODE": "4"})
    assert build(Options(("t.py",), 2, restart=1), slurm).env["HYPARFLOW_RESTART"] == "1"


def test_a_relaunch_shows_no_line_an_earlier_launch_showed():
    lines = EarlierLaunches()
    assert [lines.keep(b"Traceback"), lines.keep(b""), lines.keep(b"Traceback")] == [True] * 3
    assert lines.next_launch() == 0
    assert [lines.keep(b"Traceback"), lines.keep(b""), lines.keep(b"new")] == [False, True, True]
    assert lines.next_launch() == 1


def test_a_fixed_layout_the_ranks_no_longer_fit_names_auto_as_the_fix():
    for strategy, ranks in [
        (Strategy(partitions=2), 3),
        (Strategy(tensor=2), 3),
        (Strategy("hybrid", partitions=2, replicas=2), 2),
    ]:
        with pytest.raises(ValueError, match=f'strategy="auto".* {ranks} ranks'):
            strategy.resolve(ranks)


def test_signals_are_recorded_while_entered_and_the_old_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR1)
    with SignalFlag([signal.SIGUSR1, signal.SIGTERM]) as flag:
        assert flag.received is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
    assert flag.received == signal.SIGUSR1  # the first one
    assert signal.getsignal(signal.SIGUSR1) is before


RECORDER = """
import os, signal, sys, time
got = []
def record(number, frame):
    got.append(signal.Signals(number).name)
for number in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(number, record)
open(sys.argv[1], "w").close()
while len(got) < 2:
    time.sleep(0.01)
print(" ".join(got))
"""


def test_a_first_sigterm_reaches_the_launcher_as_sigusr1_and_a_second_as_sigterm(tmp_path):
    """mpirun forwards SIGUSR1 to the ranks, where a SIGTERM of its own would become SIGKILL
    one second later: too soon to save a step."""
    from hyparflow.run import run

    ready, out = tmp_path / "ready", tmp_path / "out"

    def signal_twice():
        while not ready.exists():
            time.sleep(0.01)
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)  # to this process, which run() forwards
            time.sleep(0.3)

    sender = threading.Thread(target=signal_twice, daemon=True)
    sender.start()
    code = f"import sys; sys.stdout = open({str(out)!r}, 'w'); exec({RECORDER!r})"
    status = run(Launch("mpirun", (sys.executable, "-c", code, str(ready))))
    sender.join()
    assert status == 0
    assert out.read_text().split() == ["SIGUSR1", "SIGTERM"]


# --- jobs under hyparflow run ------------------------------------------------------------------


def _environment(**extra) -> dict:
    return {**os.environ, **MPI_ENV, **extra}


def _hyparflow_run(arguments, env, folder) -> subprocess.Popen:
    """`hyparflow run ARGUMENTS` in its own session, its output to files in `folder`."""
    return subprocess.Popen(
        [sys.executable, "-m", "hyparflow.run", *arguments],
        cwd=REPO,
        env=env,
        stdout=open(os.path.join(folder, "stdout"), "a"),  # noqa: SIM115 - the child holds it
        stderr=open(os.path.join(folder, "stderr"), "a"),  # noqa: SIM115
        start_new_session=True,
    )


def _wait(process, timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _steps(folder) -> list[dict]:
    path = os.path.join(folder, "steps.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [json.loads(line) for line in file]


def _results(out) -> list[dict]:
    found = []
    for path in sorted(glob.glob(os.path.join(out, "rank*.json"))):
        with open(path) as file:
            found.append(json.load(file))
    return found


def _read(folder, name) -> str:
    with open(os.path.join(folder, name)) as file:
        return file.read()


def _folders(tmp_path):
    folders = [str(tmp_path / name) for name in ("out", "job", "down", "pids", "logs")]
    for folder in folders:
        os.makedirs(folder, exist_ok=True)
    return folders


pytestmark_nodes = pytest.mark.skipif(
    nodes.skip_reason() is not None, reason=str(nodes.skip_reason())
)


@pytest.mark.mpi
@pytestmark_nodes
@pytest.mark.parametrize(
    ("strategy", "before", "after"),
    [
        ("auto", None, None),  # the planner's pick for 4 ranks, then for 2
        ("pipeline", [2, 2, 1], [2, 1, 1]),
        ("tensor", [1, 2, 2], [1, 1, 2]),
    ],
)
def test_a_lost_node_is_left_out_and_the_job_resumes_on_the_ranks_left(
    tmp_path, strategy, before, after
):
    out, job, down, pids, logs = _folders(tmp_path)
    env = _environment(**nodes.environment(down), HF_NODE_PIDS=pids)
    arguments = ["--max-restarts", "1", "--oversubscribe", "--hosts", HOSTS, "-n", "4"]
    launcher = _hyparflow_run(
        [*arguments, "-m", "tests.mpi.elastic", out, "node_loss", strategy, job], env, logs
    )
    try:
        # node B's ranks stop after step 10 (epoch 2 of 3) and wait: the node goes down
        deadline = time.monotonic() + 300
        while len(glob.glob(os.path.join(pids, "*.json"))) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, _read(logs, "stderr")
            time.sleep(0.2)
        with open(glob.glob(os.path.join(pids, "*.json"))[0]) as file:
            victim = json.load(file)["pid"]
        killed = nodes.kill_node_of(victim)
        open(os.path.join(down, "nodeB"), "w").close()  # its agent refuses it from now on
        status = _wait(launcher, 300)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    errors = _read(logs, "stderr")
    assert status == 0, errors[-3000:]
    assert len(killed) >= 3, killed  # the node's daemon and its two ranks
    assert "restart 1 of 1: the job ended with status" in errors, errors[-3000:]
    assert "nodeB did not answer; relaunching 2 ranks on nodeA:2" in errors, errors[-3000:]
    steps = _steps(job)
    first = [step for step in steps if step["restart"] == 0]
    second = [step for step in steps if step["restart"] == 1]
    assert len(first) == 10 and len(second) == 16  # steps 9 and 10 redone (checkpoint at 8)
    assert (second[0]["epoch"], second[0]["batch"]) == (1, 0)
    assert {(s["epoch"], s["batch"]) for s in steps} == {(e, b) for e in range(3) for b in range(8)}
    assert before is None or first[0]["layout"] == before
    assert after is None or second[0]["layout"] == after
    assert all(s["layout"][0] * s["layout"][1] * s["layout"][2] == 2 for s in second)
    results = _results(out)
    assert len(results) == 2, errors[-3000:]
    for result in results:
        assert result["restart"] == 1 and result["epochs"] == [0, 1, 2]
        assert result["weights"] < TOLERANCE, result


def _latest_checkpoint_step(job) -> int:
    names = glob.glob(os.path.join(job, "ckpt", "ckpt-*", "manifest.json"))
    return max(int(os.path.basename(os.path.dirname(name))[5:]) for name in names)


@pytest.mark.mpi
def test_sigterm_saves_the_current_step_exits_75_and_the_next_launch_redoes_nothing(tmp_path):
    out, job, _, pids, logs = _folders(tmp_path)
    env = _environment(HF_RANK_PIDS=pids)
    arguments = ["-n", "2", "-m", "tests.mpi.elastic", out, "preempt", "auto", job]

    def preempt(after_steps: int, send) -> int:
        for old in glob.glob(os.path.join(pids, "*.pid")):
            os.remove(old)
        launcher = _hyparflow_run(arguments, env, logs)
        deadline = time.monotonic() + 300
        while len(_steps(job)) < after_steps:  # mid-epoch: 8 steps an epoch, 0.25 s each
            assert launcher.poll() is None and time.monotonic() < deadline, _read(logs, "stderr")
            time.sleep(0.05)
        send(launcher)
        return _wait(launcher, 120)

    def to_every_rank(_launcher):
        for path in glob.glob(os.path.join(pids, "*.pid")):
            with open(path) as file:
                os.kill(int(file.read()), signal.SIGTERM)

    # as a batch system signals the job script, which hyparflow run is
    assert preempt(5, lambda launcher: launcher.send_signal(signal.SIGTERM)) == PREEMPTED_STATUS
    assert _latest_checkpoint_step(job) == len(_steps(job)) >= 5  # the step it was in
    assert preempt(14, to_every_rank) == PREEMPTED_STATUS  # as scancel signals every task
    assert _latest_checkpoint_step(job) == len(_steps(job)) >= 14
    assert "hyparflow: preempted (SIGTERM): saved" in _read(logs, "stdout")
    finished = _hyparflow_run(arguments, env, logs)
    assert _wait(finished, 300) == 0, _read(logs, "stderr")[-3000:]
    steps = [(s["epoch"], s["batch"]) for s in _steps(job)]
    assert steps == [(e, b) for e in range(3) for b in range(8)]  # each step once, in order
    for result in _results(out):
        assert result["epochs"] == [0, 1, 2]
        assert result["weights"] < TOLERANCE, result


FAILS_AT_START = """
import sys
sys.stderr.write("ValueError: no training data in /scratch/missing\\n")
sys.exit(3)
"""


@pytest.mark.mpi
def test_a_script_that_fails_at_start_up_stops_after_k_tries_showing_its_error_once(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(FAILS_AT_START)
    done = subprocess.run(
        [sys.executable, "-m", "hyparflow.run", "--max-restarts", "2", "-n", "1", str(script)],
        cwd=REPO,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.count("no training data in /scratch/missing") == 1, done.stderr
    for line in ("restart 1 of 2: the job ended with status 3", "restart 2 of 2"):
        assert line in done.stderr, done.stderr
    assert "not relaunching: no restart left (--max-restarts 2)" in done.stderr
    assert "as an earlier launch's, not shown" in done.stderr
    assert done.stdout.count("mpirun -np 1") == 3  # the command of each launch

"""`hyparflow run`: the command it builds from injected facts (milliseconds, no MPI, no TF), its
options and errors from a real process, and real launches of the demo under mpirun."""

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from hyparflow.launch.command import (
    Facts,
    Launch,
    LaunchError,
    Options,
    build,
    fill_slots,
    pack,
    parse_hostfile,
    parse_hosts,
    slurm_counts,
)
from hyparflow.launch.origin import LAUNCHED_BY
from hyparflow.run import main, split_arguments, usable_cores
from tests.support.mpirun import REPO

PY = "/venv/bin/python"
DEMO = os.path.join("examples", "demo.py")
THREADS_1 = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1"}
X_THREADS = ["-x", "TF_NUM_INTRAOP_THREADS", "-x", "TF_NUM_INTEROP_THREADS"]
X_THREADS += ["-x", "OMP_NUM_THREADS"]
X_ROOT = ["-x", "OMPI_ALLOW_RUN_AS_ROOT", "-x", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"]
# What sbatch -n 2 (2 CPUs) gives its batch script, as the test cluster sets it.
BATCH = {
    "SLURM_JOB_ID": "77",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_CPUS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_JOB_NUM_NODES": "1",
}


def facts(environ=None, root=False, cores=2, tools=("mpirun",), files=("train.py",), texts=None):
    texts = texts or {}
    return Facts(
        environ=environ or {},
        root=root,
        cores=cores,
        python=PY,
        which=lambda tool: f"/usr/bin/{tool}" if tool in tools else None,
        is_file=lambda path: path in files or path in texts,
        read_text=lambda path: texts[path],
    )


def options(*program, **kwargs):
    return Options(program=program or ("train.py",), **kwargs)


def error(opts, here) -> str:
    with pytest.raises(LaunchError) as raised:
        build(opts, here)
    return str(raised.value)


# --- mpirun -----------------------------------------------------------------------------------


def test_mpirun_binds_one_core_per_rank_and_one_thread_each():
    launch = build(options("train.py", "--epochs", "3", ranks=2), facts())
    assert launch.launcher == "mpirun"
    binding = shlex.split("mpirun -np 2 --map-by slot:PE=1 --bind-to core")
    assert list(launch.argv) == [*binding, *X_THREADS, PY, "train.py", "--epochs", "3"]
    assert launch.env == THREADS_1
    assert launch.notes == ()


def test_the_cores_are_shared_out_and_size_the_thread_pools():
    launch = build(options(ranks=2), facts(cores=16))
    assert "slot:PE=8" in launch.argv
    assert launch.env == {
        "TF_NUM_INTRAOP_THREADS": "8",
        "TF_NUM_INTEROP_THREADS": "2",
        "OMP_NUM_THREADS": "8",
    }
    assert "slot:PE=2" in build(options(ranks=3), facts(cores=8)).argv  # 3 x 2 <= 8


def test_threads_the_user_set_are_kept_and_still_passed_on():
    here = facts(environ={"TF_NUM_INTRAOP_THREADS": "3", "OMP_NUM_THREADS": "3"}, cores=8)
    launch = build(options(ranks=2), here)
    assert launch.env == {"TF_NUM_INTEROP_THREADS": "2"}
    assert all(name in launch.argv for name in THREADS_1)  # -x forwards the user's values


def test_root_gets_open_mpis_two_variables_and_others_do_not():
    launch = build(options(ranks=2), facts(root=True))
    assert launch.env == {
        **THREADS_1,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    assert launch.argv[-2 - len(X_ROOT) : -2] == tuple(X_ROOT)
    assert not any(name.startswith("OMPI_ALLOW") for name in build(options(ranks=2), facts()).env)
    assert not any(word.startswith("OMPI_ALLOW") for word in build(options(ranks=2), facts()).argv)


def test_more_ranks_than_cores_is_refused_unless_asked_for():
    message = error(options(ranks=4), facts())
    assert "this machine has 2 core(s)" in message and "--oversubscribe" in message
    launch = build(options(ranks=4, oversubscribe=True), facts())
    assert list(launch.argv[:6]) == ["mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none"]
    assert "slot:PE" not in " ".join(launch.argv)
    assert launch.env == THREADS_1
    assert "not binding" in launch.notes[0] and "4 ranks, but this machine has 2" in launch.notes[0]


def test_open_mpis_own_oversubscribe_switch_counts_as_asking():
    here = facts(environ={"OMPI_MCA_rmaps_base_oversubscribe": "1"})
    launch = build(options(ranks=4), here)
    assert "--oversubscribe" not in launch.argv and "none" in launch.argv


def test_oversubscribe_is_only_added_when_asked():
    assert "--oversubscribe" not in build(options(ranks=2), facts()).argv
    launch = build(options(ranks=2, oversubscribe=True), facts())
    assert "--oversubscribe" in launch.argv and "--bind-to" in launch.argv  # 2 ranks still fit


def test_hosts_are_passed_through_and_their_slots_fill_in_order():
    launch = build(options(ranks=8, hosts="a:4,b:4"), facts(cores=8))
    assert list(launch.argv[:5]) == ["mpirun", "-np", "8", "--host", "a:4,b:4"]
    assert "slot:PE=2" in launch.argv  # 4 ranks on each 8-core host
    assert "assuming every host has 8 cores like this one" in launch.notes[0]
    assert "slot:PE=4" in build(options(ranks=3, hosts="a:2,b:2"), facts(cores=8)).argv
    # Open MPI gives a host named without a count one slot
    assert "--hosts offer 2 slot(s)" in error(options(ranks=4, hosts="a,b"), facts(cores=8))


def test_a_host_with_more_slots_than_cores_is_not_bound():
    launch = build(options(ranks=4, hosts="a:4"), facts(cores=2))
    assert "none" in launch.argv
    assert "4 ranks x 1 core(s) do not fit a's 2 cores" in launch.notes[-1]


def test_a_hostfile_is_read_for_its_slots():
    here = facts(cores=4, texts={"hosts.txt": "# cluster\nn1 slots=2\nn2   # slots: its cores\n"})
    launch = build(options(ranks=6, hostfile="hosts.txt"), here)
    assert list(launch.argv[:5]) == ["mpirun", "-np", "6", "--hostfile", "hosts.txt"]
    assert "slot:PE=1" in launch.argv  # n2 gets 4 ranks on its 4 cores
    assert "hosts.txt offers 6 slot(s)" in error(options(ranks=7, hostfile="hosts.txt"), here)
    assert "hostfile not found: gone.txt" in error(options(ranks=2, hostfile="gone.txt"), here)


def test_cpus_per_rank_overrides_and_unbinds_when_it_does_not_fit():
    launch = build(options(ranks=2, cpus_per_rank=3), facts(cores=8))
    assert "slot:PE=3" in launch.argv and launch.env["TF_NUM_INTRAOP_THREADS"] == "3"
    launch = build(options(ranks=2, cpus_per_rank=2), facts(cores=2))
    assert "none" in launch.argv and launch.env["OMP_NUM_THREADS"] == "2"


def test_no_bind_and_launcher_arguments_go_before_the_program():
    launch = build(
        options("train.py", bind=False, launcher_args=("--mca", "btl", "self,tcp"), ranks=2),
        facts(),
    )
    assert list(launch.argv[:5]) == ["mpirun", "-np", "2", "--bind-to", "none"]
    assert list(launch.argv[-5:]) == ["--mca", "btl", "self,tcp", PY, "train.py"]
    assert launch.notes == ("not binding ranks to cores: --no-bind",)


def test_mpirun_inside_slurm_uses_the_allocations_tasks_and_cpus_per_task():
    environ = {**BATCH, "SLURM_JOB_CPUS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "4"}
    here = facts(environ=environ, cores=8, tools=("mpirun", "srun"))
    launch = build(options(launcher="mpirun"), here)  # -n: the allocation's 2 tasks
    assert list(launch.argv[:7]) == [
        "mpirun",
        "-np",
        "2",
        "--map-by",
        "slot:PE=4",
        "--bind-to",
        "core",
    ]
    assert launch.env["TF_NUM_INTRAOP_THREADS"] == "4"
    assert "the Slurm allocation has 2 task(s)" in error(options(ranks=3, launcher="mpirun"), here)


# --- srun -------------------------------------------------------------------------------------


def test_inside_an_allocation_srun_starts_the_ranks_with_pmix():
    here = facts(environ=BATCH, root=True, tools=("mpirun", "srun"))
    launch = build(options("train.py", ranks=2), here)
    assert launch.launcher == "srun"
    srun = shlex.split("srun --mpi=pmix -n 2 -c 1 --cpu-bind=cores --kill-on-bad-exit=1")
    assert list(launch.argv) == [*srun, PY, "train.py"]
    assert launch.env == THREADS_1  # no Open MPI root variables: no mpirun runs
    assert build(options(), here).argv[:4] == ("srun", "--mpi=pmix", "-n", "2")  # SLURM_NTASKS


def test_srun_never_waits_forever_for_cpus_the_allocation_lacks():
    here = facts(environ=BATCH, tools=("srun",))
    message = error(options(ranks=3), here)
    assert "3 ranks x 1 CPU(s) do not fit the allocation's 2 CPU(s)" in message
    assert "--oversubscribe" in message and "wait forever" in message
    launch = build(options(ranks=3, oversubscribe=True), here)
    assert "--overcommit" in launch.argv and "--cpu-bind=none" in launch.argv
    assert "3 ranks share the allocation's 2 CPU(s)" in launch.notes[0]


def test_srun_gives_each_task_slurms_cpus_per_task_or_an_even_share():
    environ = {**BATCH, "SLURM_JOB_CPUS_PER_NODE": "8(x2)", "SLURM_CPUS_PER_TASK": "4"}
    launch = build(options(ranks=4), facts(environ=environ, tools=("srun",)))
    assert launch.argv[4:6] == ("-c", "4")
    assert launch.env == {
        "TF_NUM_INTRAOP_THREADS": "4",
        "TF_NUM_INTEROP_THREADS": "2",
        "OMP_NUM_THREADS": "4",
    }
    assert "5 ranks x 4 CPU(s)" in error(options(ranks=5), facts(environ=environ, tools=("srun",)))
    del environ["SLURM_CPUS_PER_TASK"]
    assert build(options(ranks=8), facts(environ=environ, tools=("srun",))).argv[4:6] == ("-c", "2")


def test_srun_takes_host_names_as_a_nodelist_and_refuses_what_it_cannot_honour():
    here = facts(environ={**BATCH, "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}, tools=("srun",))
    assert "--nodelist=n1,n2" in build(options(ranks=2, hosts="n1,n2"), here).argv
    assert "without slot counts" in error(options(ranks=2, hosts="n1:1,n2:1"), here)
    assert "--launcher mpirun" in error(options(ranks=2, hostfile="train.py"), here)


def test_srun_outside_an_allocation_only_when_asked():
    here = facts(tools=("srun",))
    message = error(options(ranks=2), here)
    assert "no `mpirun` on PATH" in message and "--launcher srun" in message
    launch = build(options(ranks=2, launcher="srun"), here)
    assert launch.argv[:6] == ("srun", "--mpi=pmix", "-n", "2", "-c", "1")


def test_inside_an_allocation_without_srun_mpirun_is_used():
    assert build(options(ranks=2), facts(environ=BATCH)).launcher == "mpirun"


# --- what the ranks run, and errors -----------------------------------------------------------


def test_scripts_and_modules_run_with_this_python_and_commands_as_given():
    here = facts(tools=("mpirun", "hostname"), files=("train.py", "./bin/job"))
    assert build(options("train.py", ranks=1), here).argv[-2:] == (PY, "train.py")
    assert build(options("-m", "pkg.train", "x", ranks=1), here).argv[-4:] == (
        PY,
        "-m",
        "pkg.train",
        "x",
    )
    assert build(options("hostname", ranks=1), here).argv[-1] == "hostname"
    assert build(options("./bin/job", "-v", ranks=1), here).argv[-2:] == ("./bin/job", "-v")


@pytest.mark.parametrize(
    "opts, here, words",
    [
        (options(ranks=0), facts(), "at least 1"),
        (options(), facts(), "-n N"),
        (options(ranks=2, hosts="a", hostfile="h"), facts(), "not both"),
        (options("missing.py", ranks=2), facts(), "script not found: missing.py"),
        (options("nope", ranks=2), facts(), "nope: not found"),
        (Options(program=(), ranks=2), facts(), "name the script"),
        (options("-m", ranks=2), facts(), "-m needs a module"),
        (options(ranks=2), facts(tools=()), "neither `mpirun` nor `srun`"),
        (options(ranks=2, launcher="srun"), facts(), "no `srun` on PATH"),
        (options(ranks=2, cpus_per_rank=0), facts(), "--cpus-per-rank 0"),
        (options(ranks=2, hosts="a:x"), facts(), "NAME:SLOTS"),
        (options(ranks=2), facts(environ={"OMPI_COMM_WORLD_SIZE": "2"}), "started by mpirun"),
        (
            options(ranks=2),
            facts(environ={**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}),
            "not under srun",
        ),
    ],
)
def test_errors_say_what_to_change(opts, here, words):
    assert words in error(opts, here)


def test_the_printed_line_is_the_command_a_shell_would_run():
    launch = Launch("mpirun", ("mpirun", "-np", "2", "my script.py", "a b"), {"X": "two words"})
    assert launch.line() == "X='two words' mpirun -np 2 'my script.py' 'a b'"
    words = shlex.split(launch.line())
    assert words[0] == "X=two words" and words[1:] == list(launch.argv)


def test_parsers():
    assert parse_hosts("a:2, b") == [("a", 2), ("b", None)]
    assert parse_hostfile("n1 slots=4 max_slots=8\n\n# x\nn2\n") == [("n1", 4), ("n2", None)]
    assert slurm_counts("2") == [2] and slurm_counts("36(x3),18") == [36, 36, 36, 18]
    assert fill_slots([2, 2], 3) == [2, 1] and fill_slots([2, 2], 5) == [2, 2]
    assert pack([2], 2) == 1 and pack([2], 3) == 0 and pack([5, 1], 2) == 2 and pack([], 1) == 0


def test_options_end_where_the_program_begins():
    assert split_arguments(["-n", "2", "train.py", "-n", "5"]) == (
        ["-n", "2"],
        ["train.py", "-n", "5"],
    )
    assert split_arguments(["--hosts=a,b", "-n2", "--", "-weird"]) == (
        ["--hosts=a,b", "-n2"],
        ["-weird"],
    )
    assert split_arguments(["-c", "2", "--launcher-args", "-v", "x.py"]) == (
        ["-c", "2", "--launcher-args", "-v"],
        ["x.py"],
    )
    assert split_arguments(["--dry-run"]) == (["--dry-run"], [])


def test_a_lone_launcher_argument_may_start_with_a_dash(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = ["-n", "1", "--launcher-args", "--report-bindings", "--dry-run", DEMO, "--dry-run"]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert shlex.split(printed.out)[-4:] == ["--report-bindings", sys.executable, DEMO, "--dry-run"]
    assert "--dry-run comes after the script, so the script gets it" in printed.err


def test_usable_cores_counts_this_processes_cores():
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


# --- the real command, in fresh processes ----------------------------------------------------

HYPARFLOW = os.path.join(os.path.dirname(sys.executable), "hyparflow")  # the console script


def _env(**extra):
    """This environment without what the launcher sets itself, with this checkout importable."""
    drop = ("OMPI_", "TF_NUM_", "OMP_NUM_", "SLURM_", "PMIX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2", **extra}


def _module(*args, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "hyparflow.run", *args],
        cwd=REPO,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_dry_run_prints_only_the_command_and_imports_no_tensorflow():
    probe = (
        "import sys; from hyparflow.run import main; code = main(sys.argv[1:]); "
        "heavy = [m for m in ('tensorflow', 'keras', 'mpi4py') if m in sys.modules]; "
        "print('heavy:', heavy, file=sys.stderr); sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, "-n", "2", "--dry-run", DEMO, "--epochs", "1"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "heavy: []" in done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    words = shlex.split(lines[0])
    assert "TF_NUM_INTRAOP_THREADS=1" in words
    command = words[words.index("mpirun") :]
    assert command[:3] == ["mpirun", "-np", "2"]
    assert command[-4:] == [sys.executable, DEMO, "--epochs", "1"]
    assert (os.geteuid() == 0) == ("OMPI_ALLOW_RUN_AS_ROOT=1" in words)


@pytest.mark.parametrize(
    "args, words",
    [
        (["-n", "0", DEMO], "at least 1"),
        (["-n", "2", "--hosts", "a", "--hostfile", "f", DEMO], "not allowed with argument"),
        (["-n", "2", "examples/missing.py"], "script not found: examples/missing.py"),
        (["-n", "2"], "name the script"),
        (["-n", "two", DEMO], "invalid int value"),
    ],
)
def test_bad_options_exit_with_status_2(args, words):
    done = _module(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert words in done.stderr and done.stdout == ""


def test_without_mpirun_or_srun_it_says_what_to_install():
    done = _module("-n", "2", DEMO, env=_env(PATH="/nonexistent"))
    assert done.returncode == 2
    assert "neither `mpirun` nor `srun` is on PATH: install Open MPI" in done.stderr


def test_the_console_script_lists_and_runs_run():
    listed = subprocess.run([HYPARFLOW, "--help"], env=_env(), capture_output=True, text=True)
    assert listed.returncode == 0 and "run" in listed.stdout
    helped = subprocess.run(
        [HYPARFLOW, "run", "--help"], env=_env(), capture_output=True, text=True
    )
    assert helped.returncode == 0 and "--oversubscribe" in helped.stdout
    assert helped.stdout.startswith("usage: hyparflow run")


@pytest.mark.mpi
def test_hyparflow_run_trains_the_demo_on_two_ranks():
    """The acceptance test: `hyparflow run -n 2 examples/demo.py` from a fresh process (15 s
    measured on 2 cores; its limit is 300 s)."""
    done = subprocess.run(
        [HYPARFLOW, "run", "-n", "2", DEMO],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, output
    first = shlex.split(done.stdout.splitlines()[0])
    command = first[first.index("mpirun") :]
    assert command[:7] == ["mpirun", "-np", "2", "--map-by", "slot:PE=1", "--bind-to", "core"]
    assert command[-2:] == [sys.executable, DEMO]
    assert "Trained 5 epochs on 2 ranks (strategy 'auto')" in done.stdout, output


SLEEPER = """
import os, sys, time
with open(os.path.join(sys.argv[1], f"rank{os.environ['OMPI_COMM_WORLD_RANK']}.pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.mpi
def test_sigterm_to_the_launcher_ends_the_ranks(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hyparflow.run", "-n", "2", str(script), str(tmp_path)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the signal reaches the launcher alone, not mpirun
    )
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.2)
        pids = [int(path.read_text()) for path in tmp_path.glob("rank*.pid")]
        assert len(pids) == 2, "the ranks did not start"
        launcher.send_signal(signal.SIGTERM)
        status = launcher.wait(timeout=30)
        time.sleep(1)
        assert status != 0
        assert [pid for pid in pids if _running(pid)] == [], "ranks outlived the launcher"
    finally:  # whatever happened, leave nothing running
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's session: mpirun too
        launcher.wait()


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent to collect it."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_ranks_learn_that_hyparflow_run_launched_them():
    """Their errors' hints then say `hyparflow run -n N` (launch/command.py's
    relaunch_command), not the mpirun command the user never typed."""
    from hyparflow.run import run

    marked = f"os.environ.get('{LAUNCHED_BY}') == 'hyparflow run'"
    check = f"import os, sys; sys.exit(0 if {marked} else 3)"
    assert run(Launch("mpirun", (sys.executable, "-c", check))) == 0

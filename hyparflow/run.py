"""`hyparflow run -n N script.py ...` (also `python -m hyparflow.run`): start a script on N ranks.

Inside a Slurm allocation it runs `srun --mpi=pmix`, elsewhere `mpirun`; it binds ranks to
cores, sizes TensorFlow's thread pools, prints the exact command and runs it, returning its
exit status (docs/launch.md). With `--max-restarts K` it launches again after a failure, on
the hosts that still answer (`hyparflow.launch.elastic`). A SIGTERM asks the ranks to checkpoint
and stop (`hyparflow.launch.preemption`). The command itself is built by
`hyparflow.launch.command`; this module gathers the facts of this machine, parses the options,
probes hosts and runs the commands. It imports neither TensorFlow nor MPI, so it starts in a
fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading

from hyparflow.launch import elastic
from hyparflow.launch.command import LAUNCHERS, Facts, Launch, LaunchError, Options, build
from hyparflow.launch.earlier_lines import EarlierLaunches
from hyparflow.launch.origin import LAUNCHED_BY
from hyparflow.launch.preemption import FORWARDED_AS
from hyparflow.launch.tensorflow_logs import RepeatFilter, could_become_log_line

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PROBE_SECONDS = 60.0  # a host whose probe has not started `true` by then counts as lost
ALL_LOGS = ("TF_CPP_MIN_LOG_LEVEL", "0")  # set by the user: every rank's C++ log lines, repeats too
DRAIN_SECONDS = 5.0  # for the last of standard error once the launcher has exited
_FLAGS = {"--dry-run", "--oversubscribe", "--no-bind"}  # hyparflow run's options without a value
_VALUE_OPTIONS = {
    "-n",
    "-np",
    "--ranks",
    "--hosts",
    "--host",
    "-H",
    "--hostfile",
    "--cpus-per-rank",
    "-c",
    "--launcher",
    "--launcher-args",
    "--max-restarts",
    "--min-ranks",
}


def main(argv: list[str] | None = None, prog: str = "python -m hyparflow.run") -> int:
    """Run `hyparflow run` with these arguments; returns the exit status (2: bad options).

    For example:
        main(["-n", "2", "--dry-run", "train.py", "--epochs", "3"])  # returns 0, printing
        # TF_NUM_INTRAOP_THREADS=1 ... mpirun -np 2 ... /usr/bin/python3 train.py --epochs 3
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser(prog)
    own, program = split_arguments(argv)
    args = parser.parse_args(_joined(own))  # exits with status 2 and a usage line if bad
    misplaced = [word for word in program[1:] if word in _FLAGS]
    if misplaced:
        print(
            f"{prog}: note: {' '.join(misplaced)} comes after the script, so the script gets "
            "it; the launcher's own options go before the script",
            file=sys.stderr,
        )
    options = Options(
        program=tuple(program),
        ranks=args.ranks,
        hosts=args.hosts,
        hostfile=args.hostfile,
        oversubscribe=args.oversubscribe,
        cpus_per_rank=args.cpus_per_rank,
        launcher=args.launcher,
        launcher_args=tuple(w for text in args.launcher_args for w in shlex.split(text)),
        bind=not args.no_bind,
        restart=0 if args.max_restarts else None,
    )
    try:
        if args.max_restarts < 0 or args.min_ranks < 1:
            raise LaunchError("--max-restarts must be 0 or more, --min-ranks 1 or more")
        launch = build(options, facts_here())
    except LaunchError as error:
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    _announce(prog, launch)
    if args.dry_run:
        return 0
    if not args.max_restarts:
        return run(launch)
    return Restarts(prog, options, args.max_restarts, args.min_ranks).supervise(launch)


def _announce(prog: str, launch: Launch) -> None:
    for note in launch.notes:
        print(f"{prog}: {note}", file=sys.stderr)
    print(launch.line(), flush=True)


class Restarts:
    """`--max-restarts K`: after a failed launch, probe the job's hosts and launch again on
    those that answer, up to K times (`hyparflow.launch.elastic` decides)."""

    def __init__(self, prog: str, options: Options, max_restarts: int, min_ranks: int):
        self.prog, self.options = prog, options
        self.max_restarts, self.min_ranks = max_restarts, min_ranks
        self.lines = EarlierLaunches()

    def supervise(self, launch: Launch) -> int:
        """Run `launch`, and the relaunches its failures call for; the last one's status."""
        options, restarts = self.options, 0
        while True:
            signals: list[int] = []
            status = run(launch, earlier=self.lines, signals=signals)
            self._say_held_back()
            reason = elastic.why_not_restart(status, restarts, self.max_restarts, bool(signals))
            if reason is not None:
                if status != 0:
                    self._say(f"not relaunching: {reason}")
                return status
            restarts += 1
            try:
                options, launch = self._next(options, launch, restarts, status)
            except LaunchError as error:
                self._say(f"not relaunching: {error}")
                return status

    def _next(self, options: Options, launch: Launch, restarts: int, status: int):
        """The options and command of the next launch, on the hosts that answer."""
        facts = facts_here()
        hosts = elastic.job_hosts(options, facts, _slurm_nodes(facts.environ))
        lost = [h.name for h in hosts or [] if not _answers(launch, h.name, options, facts)]
        alive = {h.name for h in hosts or []} - set(lost)
        after = elastic.relaunched(options, hosts, alive, launch.launcher, self.min_ranks)
        after = dataclasses.replace(after, restart=restarts)
        self._say(elastic.restart_line(restarts, self.max_restarts, status, lost, after))
        relaunch = build(after, facts)
        _announce(self.prog, relaunch)
        return after, relaunch

    def _say_held_back(self) -> None:
        held_back = self.lines.next_launch()
        if held_back:
            self._say(f"{held_back} line(s) of standard error as an earlier launch's, not shown")

    def _say(self, text: str) -> None:
        print(f"{self.prog}: {text}", file=sys.stderr, flush=True)


def _answers(launch: Launch, host: str, options: Options, facts: Facts) -> bool:
    """Whether the launcher can still start a process on `host` (its probe starts `true`)."""
    argv = elastic.probe_argv(launch.launcher, host, options.launcher_args)
    env = {**facts.environ, **launch.env}
    try:
        probe = subprocess.run(
            argv,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=PROBE_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _slurm_nodes(environ) -> list[str]:
    """The allocation's node names (`scontrol show hostnames`), empty outside Slurm."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or shutil.which("scontrol") is None:
        return []
    listed = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False
    )
    return listed.stdout.split() if listed.returncode == 0 else []


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """hyparflow's own options, and the program with its arguments: the program starts at the
    first word that is not an option (or a value of one), at `-m`, or after `--`.

    Example:
        >>> split_arguments(["-n", "2", "train.py", "-n", "5"])
        (['-n', '2'], ['train.py', '-n', '5'])
        >>> split_arguments(["-n", "2", "-m", "my.module", "--epochs", "3"])
        (['-n', '2'], ['-m', 'my.module', '--epochs', '3'])
    """
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return argv[:index], argv[index + 1 :]
        if word == "-m":
            return argv[:index], argv[index:]
        if not word.startswith("-") or word == "-":
            return argv[:index], argv[index:]
        index += 2 if word in _VALUE_OPTIONS else 1
    return argv, []


def _joined(own: list[str]) -> list[str]:
    """`--launcher-args -v` as `--launcher-args=-v`: argparse takes a lone value that starts
    with a dash for an option."""
    joined, index = [], 0
    while index < len(own):
        if own[index] == "--launcher-args" and index + 1 < len(own):
            joined.append(f"--launcher-args={own[index + 1]}")
            index += 2
        else:
            joined.append(own[index])
            index += 1
    return joined


def facts_here() -> Facts:
    """The facts `build` needs, read from this process and machine."""
    return Facts(
        environ=dict(os.environ),
        root=os.geteuid() == 0,
        cores=usable_cores(),
        python=sys.executable,
        which=shutil.which,
        is_file=os.path.isfile,
        read_text=_read_text,
    )


def usable_cores() -> int:
    """Physical cores this process may run on (hardware threads of one core count once, as
    Open MPI counts them for `--bind-to core`).

    Example:
        >>> 1 <= usable_cores() <= os.cpu_count()  # 2 on a 2-core VM
        True
    """
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count())
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:  # the core's (package, core) pair; without a topology, count the CPU alone
            cores.add(
                (_read_text(topology + "physical_package_id"), _read_text(topology + "core_id"))
            )
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def run(launch: Launch, earlier: EarlierLaunches | None = None, signals=None) -> int:
    """Run the command with its variables added to this environment. Returns its exit status
    (128 + N when killed by signal N).

    SIGINT and SIGHUP sent to this process are passed on. A first SIGTERM is passed on as
    SIGUSR1, which mpirun forwards to the ranks (a SIGTERM it turns into SIGKILL a second
    later): an `hf.fit` with a checkpoint callback then saves its step and exits with status 75
    (`hyparflow.launch.preemption`); a second SIGTERM is passed on as it is. Each signal
    received is appended to `signals`, if given.

    The job's standard error shows each of TensorFlow's C++ log lines once, not once per rank
    (`tensorflow_logs`), unless `TF_CPP_MIN_LOG_LEVEL=0` asks for all of them; with `earlier`,
    no line an earlier launch showed.
    """
    marked = {**os.environ, **launch.env, LAUNCHED_BY: "hyparflow run"}  # for hints (api.py)
    every_line = marked.get(ALL_LOGS[0]) == ALL_LOGS[1]
    process = subprocess.Popen(
        list(launch.argv), env=marked, stderr=None if every_line else subprocess.PIPE
    )
    relay = None
    if process.stderr is not None:
        relay = threading.Thread(
            target=relay_errors, args=(process.stderr, sys.stderr, earlier), daemon=True
        )
        relay.start()
    received = [] if signals is None else signals
    previous = {}
    try:
        for number in FORWARDED_SIGNALS:
            previous[number] = signal.signal(number, _forwarder(process, received))
    except ValueError:  # not the main thread: signals reach the launcher's group anyway
        pass
    try:
        status = process.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if relay is not None:
            relay.join(DRAIN_SECONDS)  # a rank's daemon may hold the pipe open
    return status if status >= 0 else 128 - status


def _forwarder(process, received: list):
    """The handler passing a signal on to `process`: the first SIGTERM as SIGUSR1."""

    def forward(number, _frame) -> None:
        first_term = number == signal.SIGTERM and signal.SIGTERM not in received
        received.append(number)
        process.send_signal(FORWARDED_AS if first_term else number)

    return forward


def relay_errors(source, target, earlier: EarlierLaunches | None = None) -> None:
    """Copy the job's standard error from `source` (a binary pipe) to `target` as it comes,
    leaving out TensorFlow's C++ log lines already shown, and the lines `earlier` launches
    showed. An unfinished line is passed on at once unless it may become such a line (a
    progress bar's `\\r` is not held back)."""
    repeats, pending = RepeatFilter(), b""
    out = getattr(target, "buffer", None)
    for chunk in iter(lambda: os.read(source.fileno(), 65536), b""):
        *lines, pending = (pending + chunk).split(b"\n")
        kept = [line + b"\n" for line in lines if _shown(line, repeats, earlier)]
        if pending and not could_become_log_line(pending.decode(errors="replace")):
            kept.append(pending)
            pending = b""
        _write(target, out, b"".join(kept))
    _write(target, out, pending)


def _shown(line: bytes, repeats: RepeatFilter, earlier: EarlierLaunches | None) -> bool:
    if not repeats.keep(line.decode(errors="replace")):
        return False
    return earlier is None or earlier.keep(line)


def _write(target, out, data: bytes) -> None:
    if not data:
        return
    if out is None:  # a text stream without a buffer (pytest's capture)
        target.write(data.decode(errors="replace"))
    else:
        target.flush()
        out.write(data)
    target.flush()


def _read_text(path: str) -> str:
    with open(path) as file:
        return file.read()


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [-n N] [options] (SCRIPT.py | -m MODULE | COMMAND) [ARGS...]",
        description="Start a script on N MPI ranks: with `srun --mpi=pmix` inside a Slurm "
        "allocation, `mpirun` elsewhere. Binds ranks to cores, sizes TensorFlow's threads to "
        "each rank's cores, prints the exact command, then runs it. Options come before the "
        "script; everything after the script is the script's.",
        epilog="Plain mpirun and srun keep working; see docs/launch.md.",
    )
    _add_placement_options(parser)
    _add_launcher_options(parser)
    return parser


def _add_placement_options(parser) -> None:
    """How many ranks, on which hosts, with how many cores each."""
    parser.add_argument(
        "-n",
        "-np",
        "--ranks",
        type=int,
        metavar="N",
        help="number of ranks (inside Slurm: the allocation's tasks when not given)",
    )
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument(
        "--hosts",
        "--host",
        "-H",
        metavar="LIST",
        help='mpirun: hosts and slots, e.g. "node1:4,node2:4"; srun: node names (--nodelist)',
    )
    hosts.add_argument("--hostfile", metavar="FILE", help="mpirun: an Open MPI hostfile")
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow more ranks than cores (mpirun --oversubscribe, srun --overcommit); such "
        "ranks are not bound and run one thread each",
    )
    parser.add_argument(
        "--cpus-per-rank",
        "-c",
        type=int,
        metavar="C",
        help="cores per rank (binding and thread pools); default: Slurm's --cpus-per-task, "
        "else the cores of the most crowded host divided by its ranks",
    )


def _add_launcher_options(parser) -> None:
    """Which launcher starts the ranks, with what options of its own."""
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="auto (default): srun inside a Slurm allocation, mpirun elsewhere",
    )
    parser.add_argument(
        "--launcher-args",
        action="append",
        default=[],
        metavar="ARGS",
        help='more options for mpirun or srun, placed before the script, e.g. "--mca btl '
        'self,tcp" (may be repeated)',
    )
    parser.add_argument(
        "--no-bind",
        action="store_true",
        help="do not bind ranks to cores (mpirun --bind-to none, srun --cpu-bind=none)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the command and exit without running it"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="after a failed launch, probe the job's hosts and launch again on those that "
        "answer, with the ranks they hold, up to K times (the script resumes with "
        "hf.fit(..., resume=True)); default 0",
    )
    parser.add_argument(
        "--min-ranks",
        type=int,
        default=1,
        metavar="M",
        help="with --max-restarts: do not relaunch on fewer than M ranks (default 1)",
    )


if __name__ == "__main__":
    sys.exit(main())

"""What `hyparflow run` starts: the mpirun or srun command and its environment (pure logic).

`build(options, facts)` turns the user's options and the facts of this machine (environment,
root or not, cores, which tools exist, which files exist) into a `Launch`: the argv, the
variables it adds to the environment, and notes saying why. It starts nothing, imports neither
MPI nor TensorFlow, and is unit-tested with injected facts; `hyparflow/run.py` gathers the real
facts and runs the command (docs/launch.md).

Placement model. mpirun puts ranks on hosts slot by slot, in the order the hosts are given
(this machine alone when none are; the allocation's nodes inside Slurm). Each rank gets the
largest number of cores that the most crowded host can give every rank on it; ranks are bound
to those cores (`--map-by slot:PE=C --bind-to core`, `srun -c C --cpu-bind=cores`) when they
fit, and TensorFlow's and OpenMP's thread pools are sized to C. Ranks that do not fit (more
ranks than cores, with `--oversubscribe`) are left unbound with one thread each.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS")
ROOT_VARIABLES = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
LAUNCHERS = ("auto", "mpirun", "srun")
OPEN_MPI_OVERSUBSCRIBE = "OMPI_MCA_rmaps_base_oversubscribe"  # Open MPI's own switch
MAX_INTEROP_THREADS = 2  # hyparflow runs one compiled call at a time per rank
# with --max-restarts, every rank's environment says which launch it is: 0, then 1, 2, ...
# (torchrun's TORCHELASTIC_RESTART_COUNT plays this part)
RESTART_VARIABLE = "HYPARFLOW_RESTART"


class LaunchError(ValueError):
    """The options cannot work here; the message says what to change."""


@dataclass(frozen=True)
class Options:
    """What the user asked `hyparflow run` for (its command-line options)."""

    program: tuple[str, ...]  # a script or command and its arguments, or ("-m", module, ...)
    ranks: int | None = None  # None: SLURM_NTASKS inside an allocation
    hosts: str | None = None  # Open MPI's --host syntax: "a:4,b:4"
    hostfile: str | None = None
    oversubscribe: bool = False
    cpus_per_rank: int | None = None  # None: from Slurm or from the cores per host
    launcher: str = "auto"
    launcher_args: tuple[str, ...] = ()
    bind: bool = True
    restart: int | None = None  # which launch of a job with --max-restarts (None: without)


@dataclass(frozen=True)
class Facts:
    """What `build` needs to know about this machine; `hyparflow.run.facts_here()` gathers it."""

    environ: Mapping[str, str]
    root: bool
    cores: int  # physical cores this process may run on
    python: str  # the interpreter that runs .py scripts and -m modules
    which: Callable[[str], str | None]  # a command's path on PATH, or None
    is_file: Callable[[str], bool]
    read_text: Callable[[str], str]  # a file's text (for --hostfile)


@dataclass(frozen=True)
class Launch:
    """The command to run, the variables it adds to the inherited environment, and why."""

    launcher: str  # "mpirun" or "srun"
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def line(self) -> str:
        """The command as one shell line, assignments first, e.g.
        `OMP_NUM_THREADS=1 mpirun -np 2 ... /usr/bin/python3 train.py`."""
        assignments = [f"{name}={shlex.quote(value)}" for name, value in self.env.items()]
        return " ".join([*assignments, shlex.join(self.argv)])


@dataclass(frozen=True)
class _Host:
    name: str
    cpus: int
    slots: int  # ranks the launcher places here before it must oversubscribe


def build(options: Options, facts: Facts) -> Launch:
    """The command that starts `options.program` on `options.ranks` ranks here.

    Raises `LaunchError` when it cannot work (no launcher, too many ranks, a missing script).

    Example:
        >>> facts = Facts(environ={}, root=False, cores=8, python="/usr/bin/python3",
        ...               which=lambda tool: f"/usr/bin/{tool}" if tool == "mpirun" else None,
        ...               is_file=lambda path: True, read_text=lambda path: "")
        >>> build(Options(program=("train.py",), ranks=4), facts).line()
        'TF_NUM_INTRAOP_THREADS=2 TF_NUM_INTEROP_THREADS=2 OMP_NUM_THREADS=2 mpirun -np 4 \
--map-by slot:PE=2 --bind-to core -x TF_NUM_INTRAOP_THREADS -x TF_NUM_INTEROP_THREADS \
-x OMP_NUM_THREADS /usr/bin/python3 train.py'
    """
    env = facts.environ
    if options.launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher {options.launcher!r}: use one of {', '.join(LAUNCHERS)}")
    if options.hosts is not None and options.hostfile is not None:
        raise LaunchError("give --hosts or --hostfile, not both")
    _refuse_nested(env)
    ranks = options.ranks
    if ranks is None:
        ranks = _int(env, "SLURM_NTASKS") if _in_slurm(env) else None
        if ranks is None:
            raise LaunchError("say how many ranks to start: -n N")
    if ranks < 1:
        raise LaunchError(f"-n {ranks}: the number of ranks must be at least 1")
    if options.cpus_per_rank is not None and options.cpus_per_rank < 1:
        raise LaunchError(f"--cpus-per-rank {options.cpus_per_rank}: must be at least 1")
    launcher = _choose_launcher(options.launcher, facts)
    program = _program(options.program, facts)
    if launcher == "srun":
        return _srun(options, facts, ranks, program)
    return _mpirun(options, facts, ranks, program)


def parse_hosts(text: str) -> list[tuple[str, int | None]]:
    """Open MPI's `--host` list as (name, slots) pairs; slots None where not given.

    Example:
        >>> parse_hosts("node1:4,node2")
        [('node1', 4), ('node2', None)]
    """
    hosts = []
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not slots.isdigit()):
            raise LaunchError(f"--hosts {text!r}: write NAME or NAME:SLOTS, comma-separated")
        hosts.append((name, int(slots) if slots else None))
    return hosts


def parse_hostfile(text: str) -> list[tuple[str, int | None]]:
    """An Open MPI hostfile (`node1 slots=4` per line, `#` comments) as (name, slots) pairs.

    Example:
        >>> parse_hostfile("# two nodes\\nnode1 slots=4\\nnode2 max_slots=8\\n")
        [('node1', 4), ('node2', None)]
    """
    hosts = []
    for line in text.splitlines():
        words = line.partition("#")[0].split()
        if not words:
            continue
        slots = next((w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")), None)
        if slots is not None and not slots.isdigit():
            raise LaunchError(f"hostfile line {line.strip()!r}: slots must be a number")
        hosts.append((words[0], int(slots) if slots is not None else None))
    return hosts


def slurm_counts(text: str) -> list[int]:
    """Slurm's per-node counts (SLURM_JOB_CPUS_PER_NODE, SLURM_TASKS_PER_NODE) expanded.

    Example:
        >>> slurm_counts("4(x2),2")
        [4, 4, 2]
    """
    counts = []
    for item in text.split(","):
        value, _, repeat = item.partition("(x")
        counts += [int(value)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def slurm_slots(environ: Mapping[str, str]) -> list[int] | None:
    """The ranks each node of the Slurm allocation holds: its tasks, else its CPUs; None where
    Slurm says neither.

    Example:
        >>> slurm_slots({"SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_CPUS_PER_NODE": "8(x2)"})
        [2, 2]
    """
    counts = environ.get("SLURM_TASKS_PER_NODE") or environ.get("SLURM_JOB_CPUS_PER_NODE")
    return slurm_counts(counts) if counts else None


def fill_slots(slots: Sequence[int], ranks: int) -> list[int]:
    """How many of `ranks` land on each host when each is filled up to its slots in turn
    (Open MPI's default mapping); the ranks beyond all slots are not counted.

    Example:
        >>> fill_slots([4, 4, 4], 6)
        [4, 2, 0]
    """
    placed = []
    for count in slots:
        placed.append(min(count, ranks - sum(placed)))
    return placed


def pack(cpus: Sequence[int], ranks: int) -> int:
    """The most CPUs each of `ranks` tasks can get when a task's CPUs must share a node
    (what Slurm needs for `srun -c`); 0 when there are fewer CPUs than tasks.

    Example:
        >>> pack([8, 8], 4)
        4
        >>> pack([5, 1], 2)  # 3 + 3 would not fit: one node holds both
        2
    """
    best = 0
    for per_task in range(1, max(cpus, default=0) + 1):
        if sum(count // per_task for count in cpus) >= ranks:
            best = per_task
    return best


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.isdigit() else None


def _in_slurm(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def _refuse_nested(env: Mapping[str, str]) -> None:
    """A launcher started by another launcher's ranks would start a job per rank."""
    tasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if env.get("SLURM_STEP_ID") and tasks is not None and tasks > 1:
        raise LaunchError(
            f"this is one of {tasks} tasks of an srun step: each would start its own job; run "
            "`hyparflow run` once, from the batch script or the salloc shell, not under srun"
        )
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    if world is not None and world > 1:
        raise LaunchError(
            f"this is one of {world} ranks started by mpirun: each would start its own job; run "
            "`hyparflow run` once, not under mpirun"
        )


def _choose_launcher(asked: str, facts: Facts) -> str:
    if asked != "auto":
        if facts.which(asked) is None:
            raise LaunchError(f"--launcher {asked}: no `{asked}` on PATH ({_INSTALL[asked]})")
        return asked
    inside = _in_slurm(facts.environ)
    if inside and facts.which("srun") is not None:
        return "srun"
    if facts.which("mpirun") is not None:
        return "mpirun"
    if facts.which("srun") is not None:
        raise LaunchError(
            "no `mpirun` on PATH, and this is not inside a Slurm allocation: install Open MPI "
            f"({_INSTALL['mpirun']}), or run inside `salloc`/`sbatch`, or pass --launcher srun "
            "to let srun allocate the nodes"
        )
    raise LaunchError(
        f"neither `mpirun` nor `srun` is on PATH: install Open MPI ({_INSTALL['mpirun']}) or "
        "run on a Slurm cluster"
    )


_INSTALL = {
    "mpirun": "`apt-get install openmpi-bin libopenmpi-dev`, or `module load openmpi`",
    "srun": "Slurm's client commands; on a cluster, run on a login node",
}


def _program(program: Sequence[str], facts: Facts) -> list[str]:
    """The argv each rank runs: .py scripts and -m modules with `facts.python`."""
    if not program:
        raise LaunchError("name the script to run, e.g. `hyparflow run -n 2 train.py`")
    first = program[0]
    if first == "-m":
        if len(program) < 2:
            raise LaunchError("-m needs a module name, e.g. `hyparflow run -n 2 -m my.module`")
        return [facts.python, *program]
    if first.endswith(".py"):
        if not facts.is_file(first):
            raise LaunchError(f"script not found: {first} (give a path from this folder)")
        return [facts.python, *program]
    if facts.is_file(first) or ("/" not in first and facts.which(first) is not None):
        return list(program)
    raise LaunchError(f"{first}: not found (neither a file here nor a command on PATH)")


def _threads(env: Mapping[str, str], per_rank: int) -> dict[str, str]:
    """The thread-pool variables for `per_rank` cores; values the user set are kept."""
    wanted = {
        "TF_NUM_INTRAOP_THREADS": per_rank,
        "TF_NUM_INTEROP_THREADS": min(MAX_INTEROP_THREADS, per_rank),
        "OMP_NUM_THREADS": per_rank,
    }
    return {name: str(value) for name, value in wanted.items() if name not in env}


def _restart(options: Options) -> dict[str, str]:
    """The variable telling the ranks which launch of a job with --max-restarts this is."""
    return {} if options.restart is None else {RESTART_VARIABLE: str(options.restart)}


def _mpirun_hosts(options: Options, facts: Facts) -> tuple[list[_Host], list[str], str]:
    """The hosts mpirun fills, its host arguments, and a phrase naming their slots."""
    env = facts.environ
    if options.hosts is not None:
        named = parse_hosts(options.hosts)
        # Open MPI: a host named without a count offers one slot
        hosts = [_Host(name, facts.cores, 1 if n is None else n) for name, n in named]
        return hosts, ["--host", options.hosts], "--hosts offer {slots} slot(s)"
    if options.hostfile is not None:
        if not facts.is_file(options.hostfile):
            raise LaunchError(f"hostfile not found: {options.hostfile}")
        named = parse_hostfile(facts.read_text(options.hostfile))
        if not named:
            raise LaunchError(f"{options.hostfile} names no host: write one `NAME slots=N` a line")
        # Open MPI: a hostfile line without slots offers the host's cores
        hosts = [_Host(name, facts.cores, facts.cores if n is None else n) for name, n in named]
        return (
            hosts,
            ["--hostfile", options.hostfile],
            options.hostfile + " offers {slots} slot(s)",
        )
    if _in_slurm(env):
        cpus = slurm_counts(env.get("SLURM_JOB_CPUS_PER_NODE") or str(facts.cores))
        slots = slurm_slots(env) or cpus
        hosts = [
            _Host(f"Slurm node {i}", c, s) for i, (c, s) in enumerate(zip(cpus, slots, strict=True))
        ]
        return hosts, [], "the Slurm allocation has {slots} task(s)"
    return [_Host("this machine", facts.cores, facts.cores)], [], "this machine has {slots} core(s)"


def _mpirun(options: Options, facts: Facts, ranks: int, program: list[str]) -> Launch:
    env, notes = facts.environ, []
    hosts, host_arguments, capacity = _mpirun_hosts(options, facts)
    oversubscribe = options.oversubscribe or env.get(OPEN_MPI_OVERSUBSCRIBE) in ("1", "true")
    slots = sum(host.slots for host in hosts)
    over = ranks > slots
    offered = capacity.replace("{slots}", str(slots))
    if over and not oversubscribe:
        raise LaunchError(
            f"{ranks} ranks, but {offered}: pass --oversubscribe to let "
            "ranks share cores, or ask for fewer ranks"
            + (", or give more hosts or slots" if host_arguments else "")
        )
    placed = fill_slots([host.slots for host in hosts], ranks)
    per_rank = _cores_per_rank(options, env, hosts, placed, over=over, named=bool(host_arguments))
    if host_arguments and options.cpus_per_rank is None:
        notes.append(
            f"assuming every host has {facts.cores} cores like this one "
            "(--cpus-per-rank sets the cores per rank instead)"
        )
    crowded = [(host, n) for host, n in zip(hosts, placed, strict=True) if n * per_rank > host.cpus]
    argv = ["mpirun", "-np", str(ranks), *host_arguments]
    if options.oversubscribe:
        argv.append("--oversubscribe")
    if options.bind and not over and not crowded:
        argv += ["--map-by", f"slot:PE={per_rank}", "--bind-to", "core"]
    else:
        argv += ["--bind-to", "none"]
        notes.append(_unbound(options, ranks, offered, crowded, per_rank, over=over))
    added = _threads(env, per_rank)
    names = list(THREAD_VARIABLES)
    restart = _restart(options)
    added.update(restart)
    names += list(restart)  # its name, when there is one
    if facts.root:  # Open MPI refuses root unless told twice
        added.update({name: "1" for name in ROOT_VARIABLES if name not in env})
        names += ROOT_VARIABLES
    for name in names:
        argv += ["-x", name]  # to the ranks on other hosts too
    argv += [*options.launcher_args, *program]
    return Launch("mpirun", tuple(argv), added, tuple(notes))


_PIN_HINT = " (hf.Strategy(tune_process=True) pins ranks that share cores)"


def _cores_per_rank(options, env, hosts, placed, *, over: bool, named: bool) -> int:
    """The cores each rank's threads get: asked, Slurm's, one when oversubscribed, else the
    fullest host's cores shared among its ranks."""
    slurm_cpus = _int(env, "SLURM_CPUS_PER_TASK") if not named else None
    if options.cpus_per_rank is not None:
        return options.cpus_per_rank
    if _in_slurm(env) and slurm_cpus:
        return slurm_cpus
    if over:
        return 1
    return max(1, min(host.cpus // n for host, n in zip(hosts, placed, strict=True) if n))


def _unbound(options, ranks, offered, crowded, per_rank, *, over: bool) -> str:
    """The note saying why ranks are not bound to cores."""
    if not options.bind:
        reason = "--no-bind"
    elif over:
        reason = f"{ranks} ranks, but {offered}; one thread each"
    else:
        host, n = crowded[0]
        reason = f"{n} ranks x {per_rank} core(s) do not fit {host.name}'s {host.cpus} cores"
    return f"not binding ranks to cores: {reason}{_PIN_HINT if over else ''}"


def _srun(options: Options, facts: Facts, ranks: int, program: list[str]) -> Launch:
    env, notes = facts.environ, []
    if options.hostfile is not None:
        raise LaunchError(
            "--hostfile is Open MPI's: inside Slurm, srun places ranks on the allocation's "
            "nodes; name nodes with --hosts (passed as --nodelist) or pass --launcher mpirun"
        )
    nodes = []
    if options.hosts is not None:
        named = parse_hosts(options.hosts)
        if any(slots is not None for _, slots in named):
            raise LaunchError(
                f"--hosts {options.hosts}: srun takes node names without slot counts (Slurm "
                "places the tasks); drop the :N, or pass --launcher mpirun"
            )
        nodes = [name for name, _ in named]
    inside = _in_slurm(env)
    listed = env.get("SLURM_JOB_CPUS_PER_NODE") if inside else None
    cpus = slurm_counts(listed) if listed else None  # None: srun allocates (outside a job)
    per_rank = options.cpus_per_rank or _int(env, "SLURM_CPUS_PER_TASK")
    if per_rank is None:
        per_rank = max(1, pack(cpus, ranks)) if cpus else 1
    fits = cpus is None or sum(count // per_rank for count in cpus) >= ranks
    if not fits and not options.oversubscribe:
        raise LaunchError(
            f"{ranks} ranks x {per_rank} CPU(s) do not fit the allocation's {sum(cpus)} "
            f"CPU(s) on {len(cpus)} node(s) (srun would wait forever): ask for fewer ranks, "
            + ("pass --cpus-per-rank 1, " if per_rank > 1 else "")
            + f"pass --oversubscribe, or allocate more (e.g. salloc -n {ranks})"
        )
    if not fits:
        per_rank = options.cpus_per_rank or 1
    argv = ["srun", "--mpi=pmix", "-n", str(ranks), "-c", str(per_rank)]
    if nodes:
        argv.append("--nodelist=" + ",".join(nodes))
    if options.oversubscribe:
        argv.append("--overcommit")
    if not options.bind or not fits:
        argv.append("--cpu-bind=none")
        reason = (
            "--no-bind"
            if options.bind is False
            else f"{ranks} ranks share the allocation's {sum(cpus)} CPU(s); one thread each"
            + _PIN_HINT
        )
        notes.append(f"not binding ranks to cores: {reason}")
    else:
        argv.append("--cpu-bind=cores")
    argv.append("--kill-on-bad-exit=1")  # like mpirun: a failed rank ends the job
    argv += [*options.launcher_args, *program]
    added = {**_threads(env, per_rank), **_restart(options)}  # srun passes them all on
    return Launch("srun", tuple(argv), added, tuple(notes))

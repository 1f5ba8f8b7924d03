"""`hyparflow run --max-restarts K [--min-ranks M]`: after a launch fails, whether to launch
again, on which hosts and with how many ranks (pure logic; docs/launch.md, "Restarts").

A failed launch is followed by a probe of each host the job used, through the job's own launch
path (`probe_argv`: the launcher starting `true` there, so ssh or a launch agent that cannot
reach a dead host fails the same way); the next launch uses the hosts that answered, with the
ranks their slots hold. `hyparflow/run.py` runs the probes and the launches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from hyparflow.launch.command import (
    Facts,
    LaunchError,
    Options,
    parse_hostfile,
    parse_hosts,
    slurm_slots,
)
from hyparflow.launch.preemption import PREEMPTED_STATUS


@dataclass(frozen=True)
class Host:
    """A host of the job and the ranks it holds."""

    name: str
    slots: int


def job_hosts(options: Options, facts: Facts, slurm_nodes: Sequence[str]) -> list[Host] | None:
    """The hosts a launch of `options` runs on, for probing after a failure; None when it runs
    on this machine alone, which is alive as long as this launcher is. `slurm_nodes`: the
    allocation's node names (`scontrol show hostnames`), empty outside Slurm.

    Example:
        >>> facts = Facts({}, False, 8, "python", lambda _: None, lambda _: True, lambda _: "")
        >>> job_hosts(Options(("a.py",), 4, hosts="n1:2,n2"), facts, [])
        [Host(name='n1', slots=2), Host(name='n2', slots=1)]
    """
    if options.hosts is not None:
        named = parse_hosts(options.hosts)
        return [Host(name, 1 if slots is None else slots) for name, slots in named]
    if options.hostfile is not None:
        listed = parse_hostfile(facts.read_text(options.hostfile))
        return [Host(name, facts.cores if slots is None else slots) for name, slots in listed]
    if slurm_nodes:
        counts = slurm_slots(facts.environ) or [1] * len(slurm_nodes)
        return [Host(name, count) for name, count in zip(slurm_nodes, counts, strict=False)]
    return None


def why_not_restart(status: int, restarts: int, max_restarts: int, signalled: bool) -> str | None:
    """Why the job ends with this launch's `status` (None: launch again).

    Example:
        >>> why_not_restart(137, 0, 1, False) is None
        True
        >>> why_not_restart(137, 1, 1, False)
        'no restart left (--max-restarts 1)'
    """
    if status == 0:
        return "it succeeded"
    if status == PREEMPTED_STATUS:
        return "it was preempted and saved a checkpoint: the next job resumes it"
    if signalled:
        return "hyparflow run was signalled to stop"
    if restarts >= max_restarts:
        return f"no restart left (--max-restarts {max_restarts})"
    return None


def relaunched(
    options: Options, hosts: list[Host] | None, alive: set[str], launcher: str, min_ranks: int
) -> Options:
    """`options` for the next launch: on the hosts that answered the probe (all of
    this machine when `hosts` is None), with as many ranks as they hold, no more than before.
    Raises `LaunchError` when fewer than `min_ranks` are left.

    Example:
        >>> hosts = [Host("a", 2), Host("b", 2)]
        >>> relaunched(Options(("t.py",), 4, hosts="a:2,b:2"), hosts, {"a"}, "mpirun", 1).hosts
        'a:2'
    """
    if hosts is None:
        return options
    left = [host for host in hosts if host.name in alive]
    held = sum(host.slots for host in left)
    ranks = held if options.ranks is None else min(options.ranks, held)
    if ranks < min_ranks:
        lost = ", ".join(host.name for host in hosts if host.name not in alive)
        raise LaunchError(
            f"{ranks} rank(s) left on the hosts that answer ({lost} do(es) not), fewer than "
            f"--min-ranks {min_ranks}: not relaunching"
        )
    if launcher == "srun":  # Slurm places the tasks on the nodes named
        named = ",".join(host.name for host in left)
    else:
        named = ",".join(f"{host.name}:{host.slots}" for host in left)
    return dataclasses.replace(options, ranks=ranks, hosts=named, hostfile=None)


def probe_argv(launcher: str, host: str, launcher_args: Sequence[str]) -> list[str]:
    """The command that starts `true` on `host` the way the job's ranks are started.

    Example:
        >>> probe_argv("mpirun", "nodeB", [])
        ['mpirun', '-np', '1', '--host', 'nodeB:1', 'true']
    """
    if launcher == "srun":
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", *launcher_args, "true"]
    return ["mpirun", "-np", "1", "--host", f"{host}:1", *launcher_args, "true"]


def restart_line(restart: int, max_restarts: int, status: int, lost: list[str], after) -> str:
    """The one line logged for a relaunch: which, why, and where to.

    Example:
        >>> line = restart_line(1, 2, 137, ["nodeB"], Options(("t.py",), 2, hosts="nodeA:2"))
        >>> line.split("; ")
        ['restart 1 of 2: the job ended with status 137', 'nodeB did not answer', \
'relaunching 2 ranks on nodeA:2']
    """
    answer = f"{', '.join(lost)} did not answer" if lost else "every host answers"
    where = after.hosts or "this machine"
    ranks = "its ranks" if after.ranks is None else f"{after.ranks} ranks"
    return (
        f"restart {restart} of {max_restarts}: the job ended with status {status}; {answer}; "
        f"relaunching {ranks} on {where}"
    )

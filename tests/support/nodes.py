"""Emulated nodes for tests: several host names on this machine (scripts/emulated_nodes.sh).

Each node's ranks run in a UTS namespace of its own, so Open MPI sees separate nodes: shared
memory within a node, TCP over the loopback interface between nodes. `mpirun(hosts)` is the
launcher prefix that tests/support/mpirun.py's `launch` takes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess

from tests.support.mpirun import REPO

SCRIPT = os.path.join(REPO, "scripts", "emulated_nodes.sh")
# Open MPI's `btl_base_verbose 1` line naming the transport from one rank to another.
_BTL_LINE = re.compile(
    r"\[([^:\]]+):\d+\] mca: bml: Using (\w+) btl for send to \[\[\d+,\d+\],(\d+)\] on node (\S+)"
)


def environment(down: str) -> dict[str, str]:
    """The emulated nodes' launch agent and loopback settings as OMPI_MCA_* variables (what
    `emulated_nodes.sh --environment` prints), for any mpirun; a host named by a file in the
    folder `down` refuses new processes."""
    printed = subprocess.run(
        ["sh", SCRIPT, "--environment"], capture_output=True, text=True, check=True
    ).stdout
    settings = dict(line.removeprefix("export ").split("=", 1) for line in printed.splitlines())
    return {name: value.strip("'") for name, value in settings.items()} | {
        "EMULATED_NODES_DOWN": down
    }


def kill_node_of(pid: int) -> list[int]:
    """SIGKILL every process of `pid`'s emulated node (its UTS namespace): the node's Open MPI
    daemon and its ranks, as if the node had lost power. Returns their pids."""
    node = os.readlink(f"/proc/{pid}/ns/uts")
    victims = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/uts") == node:
                    victims.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    return victims


def skip_reason() -> str | None:
    """Why emulated nodes cannot run here, or None."""
    missing = [tool for tool in ("mpirun", "unshare", "hostname") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (util-linux, Open MPI)"
    try:
        probe = subprocess.run(
            ["unshare", "--uts", "hostname", "hf-probe"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot start a UTS namespace: {error}"
    if probe.returncode != 0:
        return (
            f"cannot start a UTS namespace (needs root or user namespaces): {probe.stderr.strip()}"
        )
    return None


def mpirun(hosts: str) -> tuple[str, ...]:
    """The launcher for nodes `hosts` ("nodeA:2,nodeB:2"), with each rank's transport to each
    other rank logged (`btl_choices` reads it from the rank's stderr)."""
    return (SCRIPT, hosts, "--mca", "btl_base_verbose", "1")


def btl_choices(stderr: str) -> set[tuple[str, str, int, str]]:
    """(this rank's host, transport, peer rank, peer's host) for each peer Open MPI set up."""
    return {(h, btl, int(peer), node) for h, btl, peer, node in _BTL_LINE.findall(stderr)}

"""Per-process memory caps for tests: run a command (or each MPI rank) in its own cgroup.

As a program it is the per-rank wrapper that mpirun launches:

    mpirun -np 4 python -m tests.support.cgroup 800M -- python -m tests.mpi.memory_checks ...

It creates `hyparflow-test-<pid>` under its own memory cgroup (v1 `memory.limit_in_bytes`,
and `memory.memsw.limit_in_bytes` where present; v2 `memory.max`, `memory.swap.max`), sets
the limit, starts the command inside it, waits, writes what happened (exit status, whether
the kernel killed it for memory, peak usage) as JSON to `$HYPARFLOW_CGROUP_REPORTS/
rank<N>.json` when that variable is set, removes the cgroup and exits with the command's
status (128 + signal when killed, as a shell reports it).

Tests call `skip_reason()` (None where a writable memory controller exists), `run_capped` for
one process and `launch_capped` for an MPI scenario.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tests.support.mpirun import REPO, _load_json, launch

ROOT = "/sys/fs/cgroup"
_REPORTS = "HYPARFLOW_CGROUP_REPORTS"  # where the wrapper writes rank<N>.json
_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


def parse_bytes(text: str) -> int:
    """ "800M", "1.5G", "4096" as bytes."""
    text = str(text).strip().lower()
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def controller() -> tuple[str, str] | None:
    """("v1" or "v2", the directory new cgroups go in) for a writable memory controller."""
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    v1 = os.path.join(ROOT, "memory")
    if os.path.exists(os.path.join(v1, "memory.limit_in_bytes")):
        own = next((ln.split(":", 2)[2] for ln in lines if ":memory:" in ln), "/")
        for parent in (os.path.join(v1, own.lstrip("/")), v1):  # under our own cgroup first
            if os.path.isdir(parent) and os.access(parent, os.W_OK):
                return "v1", parent
        return None
    controllers = os.path.join(ROOT, "cgroup.controllers")
    if "memory" in _text(controllers).split():
        own = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), "/")
        parent = os.path.join(ROOT, own.lstrip("/"))
        subtree = os.path.join(parent, "cgroup.subtree_control")
        if os.access(parent, os.W_OK) and "memory" in _text(subtree).split():
            return "v2", parent
    return None


def skip_reason() -> str | None:
    """Why memory caps cannot be tested here, or None."""
    try:
        found = controller()
    except OSError as error:
        return f"cannot read this process's cgroups: {error}"
    if found is None:
        return (
            "no writable cgroup memory controller (v1 /sys/fs/cgroup/memory or v2 memory.max "
            "with the memory controller delegated): run as root or in a delegated cgroup"
        )
    return None


class Cap:
    """A cgroup with a memory limit; `add(pid)` moves a process in, `outcome()` reads what
    happened, `remove()` deletes it (once its processes have ended)."""

    def __init__(self, limit: int, name: str | None = None):
        self.version, parent = controller() or (None, None)
        if self.version is None:
            raise RuntimeError(skip_reason())
        self.limit = limit
        self.path = os.path.join(parent, name or f"hyparflow-test-{os.getpid()}")
        os.makedirs(self.path, exist_ok=True)
        if self.version == "v1":
            _write(self.path, "memory.limit_in_bytes", limit)
            if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                _write(self.path, "memory.memsw.limit_in_bytes", limit)  # no swap to escape to
        else:
            _write(self.path, "memory.max", limit)
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                _write(self.path, "memory.swap.max", 0)

    def add(self, pid: int) -> None:
        _write(self.path, "cgroup.procs", pid)

    def outcome(self) -> dict:
        """Peak usage, limit hits and OOM kills the kernel counted in this cgroup."""
        if self.version == "v1":
            oom = _fields(_text(os.path.join(self.path, "memory.oom_control")))
            return {
                "peak": _int(os.path.join(self.path, "memory.max_usage_in_bytes")),
                "failcnt": _int(os.path.join(self.path, "memory.failcnt")),
                "oom_kills": oom.get("oom_kill", 0),
            }
        events = _fields(_text(os.path.join(self.path, "memory.events")))
        return {
            "peak": _int(os.path.join(self.path, "memory.peak")),
            "failcnt": events.get("max", 0),
            "oom_kills": events.get("oom_kill", 0),
        }

    def remove(self) -> None:
        for _ in range(50):  # a killed process leaves the cgroup a moment after it is reaped
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


@dataclass
class Outcome:
    """How a capped process ended."""

    returncode: int
    limit: int
    peak: int
    failcnt: int
    oom_kills: int

    @property
    def killed_for_memory(self) -> bool:
        """Killed by SIGKILL while the kernel counted an OOM kill (or, on kernels without that
        counter, hit the limit)."""
        killed = self.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
        return killed and (self.oom_kills > 0 or self.failcnt > 0)


def run_capped(limit, command: list[str], timeout: float = 300, env=None) -> Outcome:
    """Run `command` with at most `limit` bytes ("800M" or an int) of memory; never raises
    on the command's failure.

    Example:
        >>> run_capped("64M", [sys.executable, "-c", "b'x' * 2**28"]).killed_for_memory
        True
    """
    with tempfile.TemporaryDirectory(prefix="hf-cap-") as reports:
        wrapped = [sys.executable, "-m", "tests.support.cgroup", str(limit), "--", *command]
        proc = subprocess.run(
            wrapped,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO, **(env or {}), _REPORTS: reports},
            timeout=timeout,
            capture_output=True,
        )
        report = _load_json(os.path.join(reports, "rank0.json"))
    if report is None:
        raise AssertionError(f"the cgroup wrapper wrote no report:\n{proc.stderr.decode()[-3000:]}")
    return Outcome(**report)


def launch_capped(scenario: str, np: int, limit, *args: str, timeout: float = 300, env=None):
    """`tests.support.mpirun.launch` with each rank in its own cgroup of `limit` bytes:
    returns (the MpiRun, one `Outcome` per rank, None where a rank wrote none)."""
    outcomes: list = []

    def collect(scratch: str) -> None:
        for r in range(np):
            report = _load_json(os.path.join(scratch, "cgroups", f"rank{r}.json"))
            outcomes.append(None if report is None else Outcome(**report))

    prefix = [sys.executable, "-m", "tests.support.cgroup", str(limit), "--"]
    env = {**(env or {}), _REPORTS: os.path.join("{scratch}", "cgroups")}
    run = launch(scenario, np, *args, timeout=timeout, env=env, prefix=prefix, collect=collect)
    return run, outcomes


def _wrap(argv: list[str]) -> int:
    """The wrapper: `LIMIT -- COMMAND...` run in a fresh capped cgroup; returns its status."""
    limit, separator, *command = argv
    if separator != "--" or not command:
        print("usage: python -m tests.support.cgroup LIMIT -- COMMAND...", file=sys.stderr)
        return 2
    cap = Cap(parse_bytes(limit))
    try:
        child = subprocess.Popen(command, preexec_fn=lambda: cap.add(os.getpid()))
        # the wrapper stays outside the cgroup; mpirun's signals reach the command through it
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: child.send_signal(s))
        returncode = child.wait()
        outcome = cap.outcome()
    finally:
        cap.remove()
    reports = os.environ.get(_REPORTS)
    if reports:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0"))
        os.makedirs(reports, exist_ok=True)
        with open(os.path.join(reports, f"rank{rank}.json"), "w") as f:
            json.dump({"returncode": returncode, "limit": cap.limit, **outcome}, f)
    return 128 - returncode if returncode < 0 else returncode


def _write(directory: str, name: str, value) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(str(value))


def _text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _int(path: str) -> int:
    text = _text(path).strip()
    return int(text) if text.isdigit() else 0


def _fields(text: str) -> dict:
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


if __name__ == "__main__":
    sys.exit(_wrap(sys.argv[1:]))

"""The machine and software versions a set of measurements was taken on."""

from __future__ import annotations

import json
import os
import platform
import subprocess

VERSIONS_CODE = """
import json, platform
out = {"python": platform.python_version()}
for name in ("tensorflow", "keras", "mpi4py", "numpy", "horovod"):
    try:
        out[name] = __import__(name).__version__
    except Exception:
        out[name] = None
print("VERSIONS " + json.dumps(out))
"""


def _proc_field(path: str, key: str) -> str | None:
    """The value after `key:` in a /proc file, or None."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)
    except OSError:
        return None


def _output(command: list[str], **kwargs) -> str:
    """A command's stdout, or "" when it cannot run."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def python_versions(python: str) -> dict:
    """Versions of the stack importable by interpreter `python` (None where missing)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    for line in _output([python, "-c", VERSIONS_CODE], env=env).splitlines():
        if line.startswith("VERSIONS "):
            return json.loads(line[len("VERSIONS ") :])
    return {}


def describe(pythons: dict[str, str]) -> dict:
    """Cores, CPU model, RAM, Open MPI, and per venv the Python stack's versions."""
    memory_kib = _proc_field("/proc/meminfo", "MemTotal") or "0 kB"
    mpi = _output(["mpirun", "--version"]).strip().splitlines()
    cpu = _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown"
    venvs = {name: python_versions(python) for name, python in pythons.items()}
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(int(memory_kib.split()[0]) / 2**20, 1),
        "kernel": platform.release(),
        "open_mpi": mpi[0].split()[-1] if mpi else None,
        "venvs": venvs,
    }

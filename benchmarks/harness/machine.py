"""The machine and software versions a set of measurements was taken on."""

from __future__ import annotations

import os
import platform
import subprocess

VERSIONS_CODE = r"""
import json, platform, sys
out = {"python": platform.python_version()}
for name, module in (("tensorflow", "tensorflow"), ("keras", "keras"), ("mpi4py", "mpi4py"),
                     ("numpy", "numpy"), ("horovod", "horovod")):
    try:
        out[name] = __import__(module).__version__
    except Exception:
        out[name] = None
print("VERSIONS " + json.dumps(out))
"""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def open_mpi_version() -> str | None:
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    return first.split()[-1] if first else None


def python_versions(python: str) -> dict:
    """Versions of the stack importable by interpreter `python` (None where missing)."""
    import json

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    try:
        out = subprocess.run(
            [python, "-c", VERSIONS_CODE], capture_output=True, text=True, timeout=300, env=env
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    for line in out.stdout.splitlines():
        if line.startswith("VERSIONS "):
            return json.loads(line[len("VERSIONS ") :])
    return {}


def describe(pythons: dict[str, str]) -> dict:
    """Cores, CPU model, RAM, Open MPI, and per venv the Python stack's versions."""
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "memory_gib": round(memory_gib(), 1),
        "kernel": platform.release(),
        "open_mpi": open_mpi_version(),
        "venvs": {name: python_versions(python) for name, python in pythons.items()},
    }

"""Run a Python snippet in a fresh interpreter: process-wide state (glibc, env) starts clean."""

import os
import subprocess
import sys


def python_output(code: str, **env) -> str:
    """The snippet's stdout; raises with its stderr if it fails."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise AssertionError(f"probe failed:\n{result.stderr[-2000:]}")
    return result.stdout

"""The layering contract (pyproject's [tool.importlinter]) holds, and fails on an upward import."""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def _lint(root: str) -> subprocess.CompletedProcess:
    """Run lint-imports on the `hyparflow` package and pyproject.toml found in `root`."""
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},  # this copy of the package, not the installed one
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_package(tmp_path) -> str:
    root = str(tmp_path)
    shutil.copytree(
        os.path.join(REPO, "hyparflow"),
        os.path.join(root, "hyparflow"),
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copy(os.path.join(REPO, "pyproject.toml"), root)
    return root


def test_the_package_keeps_its_layers(tmp_path):
    result = _lint(_copy_package(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    root = _copy_package(tmp_path)
    planted = os.path.join(root, "hyparflow", "comm", "world.py")
    with open(planted, "a") as file:  # comm (bottom layer) reaching up into the engine
        file.write("\nfrom hyparflow.engine import pipeline as _planted  # noqa: E402,F401\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "hyparflow.comm is not allowed to import hyparflow.engine" in result.stdout
    assert "hyparflow.comm.world -> hyparflow.engine.stages.walk" in result.stdout


def _lines(folder: str) -> dict[str, int]:
    counts = {}
    for root, _, files in os.walk(os.path.join(REPO, folder)):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as file:
                    counts[os.path.relpath(os.path.join(root, name), REPO)] = len(file.readlines())
    return counts


def test_code_stays_in_proportion():
    """Issue 27's sizes: modules of one idea, a first-order simulator, lean benchmarks."""
    package = _lines("hyparflow")
    assert {path: n for path, n in package.items() if n > 450} == {}
    # simulate/ grew by the tensor shares' schema and ZeRO-1's and interleaving's prices (issue
    # 41), and by timing models that take a dict and embeddings' row slices (issue 64): still
    # first order
    assert sum(n for path, n in package.items() if path.startswith("hyparflow/simulate/")) <= 1430
    # benchmarks/ grew by the mixture-of-experts figure (issue 42)
    assert sum(_lines("benchmarks").values()) <= 3100

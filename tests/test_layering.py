"""The layering contract (pyproject's [tool.importlinter]) holds, and fails on an upward import."""

import os
import shutil
import subprocess
import sys

from tests.support.sources import python_sources

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
    assert "2 kept, 0 broken" in result.stdout


def test_an_import_up_the_engine_breaks_its_contract(tmp_path):
    root = _copy_package(tmp_path)
    planted = os.path.join(root, "hyparflow", "engine", "gradients", "flat.py")
    with open(planted, "a") as file:  # the gradient path reaching up into the stages' runners
        file.write("\nfrom hyparflow.engine.stages import runner as _planted  # noqa: E402,F401\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "hyparflow.engine.gradients is not allowed to import hyparflow.engine.stages" in (
        result.stdout
    )


def test_an_upward_import_breaks_the_contract(tmp_path):
    root = _copy_package(tmp_path)
    planted = os.path.join(root, "hyparflow", "comm", "world.py")
    with open(planted, "a") as file:  # comm (bottom layer) reaching up into the engine
        file.write("\nfrom hyparflow.engine.stages import walk as _planted  # noqa: E402,F401\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "hyparflow.comm is not allowed to import hyparflow.engine" in result.stdout
    assert "hyparflow.comm.world -> hyparflow.engine.stages.walk" in result.stdout


def test_a_module_holds_one_concept_at_the_length_it_needs():
    """No cap splits a concept over files (issue 63); past 800 lines a module holds several."""
    lengths = {path: text.count("\n") for path, text in python_sources("hyparflow").items()}
    assert {path: n for path, n in lengths.items() if n > 800} == {}

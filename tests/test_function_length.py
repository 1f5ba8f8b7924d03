"""The function-size rule (issue #40): no body over 60 lines, nor over ruff's limits."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "check_function_length.py")
RUFF = os.path.join(os.path.dirname(sys.executable), "ruff")


def _check(*paths) -> subprocess.CompletedProcess:
    """Run the length check on `paths` (none: the project's code)."""
    return subprocess.run(
        [sys.executable, SCRIPT, *map(str, paths)], capture_output=True, text=True, timeout=120
    )


def _function(name: str, body_lines: int) -> str:
    """A function with a docstring and `body_lines` lines of body after it."""
    body = "".join(f"    x{i} = {i}\n" for i in range(body_lines - 1))
    return f'def {name}():\n    """Doc."""\n{body}    return 0\n'


def test_the_project_keeps_functions_under_sixty_lines():
    result = _check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_a_sixty_one_line_function_fails_and_sixty_passes(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(_function("at_limit", 60) + "\n\n" + _function("too_long", 61))
    result = _check(planted)
    assert result.returncode == 1
    # at_limit: def, docstring, 60 lines; two blank lines; too_long starts on line 65
    assert result.stdout.splitlines() == [f"{planted.resolve()}:65 too_long 61 lines"]
    planted.write_text(_function("at_limit", 60))
    assert _check(tmp_path).returncode == 0


def test_ruff_counts_statements_and_branches_with_the_project_config(tmp_path):
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(13))
    planted = tmp_path / "planted.py"
    branchy = "def branchy(x):\n" + branches + "    return -1\n"
    planted.write_text(_function("many", 41) + "\n\n" + branchy)
    result = subprocess.run(
        [RUFF, "check", "--no-cache", "--config", os.path.join(REPO, "pyproject.toml"), planted],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "PLR0915" in result.stdout and "C901" in result.stdout, result.stdout

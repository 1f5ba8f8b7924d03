"""Fail when a function's body, after its docstring, runs over 60 lines (issue #40)."""

import ast
import sys
from pathlib import Path

LIMIT = 60
ROOTS = ("hyparflow", "tests", "scripts", "benchmarks", "examples")
PROJECT = Path(__file__).resolve().parents[1]
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines from the first statement after the docstring to the function's last line."""
    body = function.body
    if ast.get_docstring(function, clean=False) is not None and len(body) > 1:
        body = body[1:]
    first = body[0]
    # A decorated nested function starts at its first decorator.
    start = min([first.lineno, *(d.lineno for d in getattr(first, "decorator_list", []))])
    return function.end_lineno - start + 1


def shown(path: Path) -> Path:
    """The path as printed: relative to the project where it lies inside it."""
    path = path.resolve()
    return path.relative_to(PROJECT) if path.is_relative_to(PROJECT) else path


def offenders(path: Path, limit: int = LIMIT) -> list[str]:
    """`path:line name N lines` for each function in the file whose body is over the limit."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, FUNCTIONS) and (lines := body_lines(node)) > limit:
            found.append((node.lineno, f"{shown(path)}:{node.lineno} {node.name} {lines} lines"))
    return [line for _, line in sorted(found)]


def python_files(paths: list[Path]) -> list[Path]:
    """The .py files named, or found under the folders named."""
    files = []
    for path in paths:
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def main(argv: list[str]) -> int:
    """Print each offender under the folders given (default: the project's code); 1 if any."""
    default = [PROJECT / root for root in ROOTS if (PROJECT / root).exists()]
    paths = [Path(arg) for arg in argv] or default
    found = [line for path in python_files(paths) for line in offenders(path)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

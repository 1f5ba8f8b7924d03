"""The text of the project's own Python files, for tests that scan the code itself."""

import os

from tests.support.mpirun import REPO


def python_sources(*folders: str) -> dict[str, str]:
    """Each Python file's text below `folders` (relative to the repository), by its path from
    the repository."""
    texts = {}
    for folder in folders:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path) as file:
                        texts[os.path.relpath(path, REPO)] = file.read()
    return texts

"""The shell commands a page of docs/ shows, read from its fenced code blocks, so that a test
runs them as written (issue 64: the docs' `plan --auto` commands had drifted from the code)."""

from __future__ import annotations

import os
import re
import shlex

from tests.support.mpirun import REPO

_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)


def commands(page: str, prefix: str) -> list[list[str]]:
    """Every command in `page`'s code blocks (docs/<page>) that starts with `prefix`, as argv,
    its backslash-continued lines joined."""
    with open(os.path.join(REPO, "docs", page)) as f:
        text = f.read()
    found = []
    for block in _FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(prefix):
                found.append(shlex.split(line))
    return found

"""Every relative link in README.md, docs/ and tutorials/README.md resolves in the repository."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _documents() -> list[str]:
    paths = [os.path.join(REPO, "README.md")]
    for folder, _, files in os.walk(os.path.join(REPO, "docs")):
        paths += [os.path.join(folder, name) for name in files if name.endswith(".md")]
    tutorials = os.path.join(REPO, "tutorials", "README.md")
    return paths + ([tutorials] if os.path.exists(tutorials) else [])


@pytest.mark.parametrize("path", _documents(), ids=lambda p: os.path.relpath(p, REPO))
def test_links_resolve_inside_the_repository(path):
    with open(path) as file:
        text = file.read()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # web pages and anchors within the page
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
        inside = resolved.startswith(REPO + os.sep)
        assert inside, f"{os.path.relpath(path, REPO)} links outside the repository: {target}"
        assert os.path.exists(resolved), f"{os.path.relpath(path, REPO)}: {target} is missing"

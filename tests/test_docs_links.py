"""Every relative link in README.md, docs/ and tutorials/README.md resolves in the repository,
and every `.md` file named in the code, tests and prose exists."""

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


# A file named in prose, a comment or a docstring (`docs/gpu.md`, `results.md`), not as a link.
NAMED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")
SCANNED = ("hyparflow", "docs", "tests", "benchmarks", "scripts", "examples")
REMOVED = {"benchmarks/analysis.md"}  # named as a file that was removed (docs/notes/benchmarks.md)


def _texts() -> list[str]:
    paths = [os.path.join(REPO, "README.md"), os.path.join(REPO, "Makefile")]
    for top in SCANNED:
        for folder, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            paths += [os.path.join(folder, f) for f in files if f.endswith((".py", ".md", ".sh"))]
    return [p for p in paths if p != os.path.abspath(__file__)]  # this file names missing ones


def _names_resolve(path: str, text: str, basenames: set[str]) -> list[str]:
    """The `.md` files `text` names that exist neither from the repository's root, docs/ nor
    `path`'s folder (nor, for a bare name, anywhere in the repository)."""
    missing = []
    for name in NAMED.findall(text):
        places = (REPO, os.path.join(REPO, "docs"), os.path.dirname(path))
        found = any(os.path.exists(os.path.join(place, name)) for place in places)
        if not found and not ("/" not in name and name in basenames) and name not in REMOVED:
            missing.append(name)
    return missing


def test_files_named_in_code_and_prose_exist():
    basenames = {os.path.basename(p) for p in _texts()}
    missing = {}
    for path in _texts():
        with open(path, encoding="utf-8") as file:
            names = _names_resolve(path, file.read(), basenames)
        if names:
            missing[os.path.relpath(path, REPO)] = names
    assert missing == {}


def test_a_named_missing_file_is_found(tmp_path):
    path = str(tmp_path / "module.py")
    text = '"""See DESIGN.md section 4 and docs/gpu.md."""\n'
    assert _names_resolve(path, text, {"README.md"}) == ["DESIGN.md"]

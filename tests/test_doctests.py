"""Every `>>>` example in hyparflow/ and benchmarks/ runs as written (issue #40).

The modules are found by walking the folders, so a new module's examples are checked without
anyone listing them. Examples that need MPI ranks, a GPU, a trained model or files are plain
indented text in their docstrings, not `>>>` examples.
"""

from __future__ import annotations

import doctest
import importlib
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("hyparflow", "benchmarks")

# Modules known to hold examples (those checked one by one before): the walk must find at
# least these, so that it cannot silently find none.
KNOWN = {
    "benchmarks.harness.records",
    "benchmarks.harness.stats",
    "benchmarks.simulator_validation",
    "hyparflow.callbacks.aggregate",
    "hyparflow.callbacks.breakdown",
    "hyparflow.callbacks.scalars",
    "hyparflow.callbacks.summary",
    "hyparflow.callbacks.timeline",
    "hyparflow.comm.allreduce",
    "hyparflow.comm.cuda_aware",
    "hyparflow.comm.dlpack",
    "hyparflow.comm.hugepages",
    "hyparflow.comm.placement",
    "hyparflow.comm.rows",
    "hyparflow.comm.topology",
    "hyparflow.engine.gradients.flat",
    "hyparflow.engine.gradients.form",
    "hyparflow.schedule.actions",
    "hyparflow.schedule.builders",
    "hyparflow.schedule.interleaved",
    "hyparflow.schedule.simulation",
    "hyparflow.schedule.validation",
    "hyparflow.schedule.zero_bubble",
    "hyparflow.launch.gpu",
    "hyparflow.partitioner.balance",
    "hyparflow.units",
    "hyparflow.simulate.costs",
    "hyparflow.simulate.network",
    "hyparflow.simulate.placement",
}


def modules_with_examples() -> list[str]:
    """Dotted names of the modules under FOLDERS whose source holds a `>>>` example.

    Read as text, not imported: collecting the tests stays cheap when they are deselected.
    """
    found = []
    for folder in FOLDERS:
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as file:
                    if ">>>" not in file.read():
                        continue
                dotted = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".")
                found.append(dotted.removesuffix(".__init__"))
    return found


MODULES = modules_with_examples()


def test_the_walk_finds_the_known_modules():
    missing = KNOWN - set(MODULES)
    assert not missing, f"the walk found no examples in {sorted(missing)}"


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name):
    module = importlib.import_module(name)
    # ELLIPSIS: a long message's tail may be shown as "..." in the docstring.
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} holds '>>>' but doctest found no example in it"
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed (output above)"

"""Session-wide test plumbing: one folder of shared Keras references for every launch (and every
pytest-xdist worker), and a report of every mpirun launch's wall time against its limit at the
end of a pytest run."""

import dataclasses
import json
import os
import shutil
import tempfile

import pytest

from tests.support import pool
from tests.support.mpirun import LAUNCHES, MPI_ALLOWED_ENV, REFERENCES_ENV, Launch, sharing

# A launch's limit must be at least twice its slowest measured duration (docs/testing.md):
# one that used more than this share of it is named in the summary.
HEADROOM = 0.5


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    """The main process makes the references folder; xdist's workers, started after this, inherit
    its name through the environment (tests/support/references.py)."""
    if _is_worker(config) or os.environ.get(REFERENCES_ENV):
        return
    config._hf_references = tempfile.mkdtemp(prefix="hf-references-")
    os.environ[REFERENCES_ENV] = config._hf_references


def pytest_unconfigure(config):
    folder = getattr(config, "_hf_references", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[REFERENCES_ENV]


# The longest files, slowest first (the launch report of a full run): pytest-xdist's loadfile
# scheduling hands files out in collection order, so these start first and a long file does not
# run alone at the end while the other worker idles.
LONGEST_FILES = [
    "test_real_models.py",
    "test_engine.py",
    "test_tensor_parallel.py",
    "test_keras_inputs.py",
    "test_tutorials.py",
    "test_memory_plan.py",
    "test_memory_caps.py",
    "test_reliability.py",
    "test_deferred.py",
    "test_nodes.py",
    "test_hdf5.py",
    "test_zero.py",
    "test_partitioner_applications.py",
    "test_slurm.py",
]


def pytest_collection_modifyitems(config, items):
    """With several workers, the longest files come first, and each test's pytest-timeout grows
    with the workers sharing the cores, as launch limits do (tests/support/mpirun.py): limits
    are set for a test alone on the machine."""
    workers = sharing()
    if workers == 1:
        return
    rank = {name: k for k, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable
    for item in items:
        mark = item.get_closest_marker("timeout")
        limit = float(mark.args[0]) if mark and mark.args else float(config.getini("timeout"))
        item.add_marker(pytest.mark.timeout(limit * workers), append=False)


def pytest_runtest_setup(item):
    """Only a test marked `mpi` may launch mpirun (its module fixtures launch in its setup)."""
    os.environ[MPI_ALLOWED_ENV] = "1" if item.get_closest_marker("mpi") else "0"


def pytest_sessionfinish(session):
    """This process's pools of ranks stop; a worker hands its launches to the main process,
    which prints the summary."""
    pool.stop_all()
    if _is_worker(session.config):
        launches = [dataclasses.asdict(launch) for launch in LAUNCHES]
        session.config.workeroutput["hf_launches"] = json.dumps(launches)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for launch in json.loads(node.workeroutput.get("hf_launches", "[]")):
        LAUNCHES.append(Launch(**launch))


def pytest_terminal_summary(terminalreporter):
    if not LAUNCHES:
        return
    write = terminalreporter.write_line
    terminalreporter.section("mpirun launches, slowest first")
    slowest = sorted(LAUNCHES, key=lambda launch: launch.seconds, reverse=True)
    for launch in slowest[:15]:
        share = launch.seconds / launch.timeout
        flag = "  <- over half its limit" if share > HEADROOM else ""
        write(
            f"{launch.seconds:7.1f} s of {launch.timeout:5.0f} s  np={launch.np}  "
            f"{launch.scenario}  {launch.test}{flag}"
        )
    total = sum(launch.seconds for launch in LAUNCHES)
    write(f"{len(LAUNCHES)} launches, {total:.0f} s in all")

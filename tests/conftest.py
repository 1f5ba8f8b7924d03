"""Session-wide test plumbing: one folder of shared Keras references for every launch, and a
report of every mpirun launch's wall time against its limit at the end of a pytest run."""

import os

import pytest

from tests.support.mpirun import LAUNCHES, REFERENCES_ENV, run_scenario

# A launch's limit must be at least twice its slowest measured duration (docs/testing.md):
# one that used more than this share of it is named in the summary.
HEADROOM = 0.5


@pytest.fixture(scope="session", autouse=True)
def shared_references(tmp_path_factory):
    """Launches of this session read each other's Keras references (tests/support/references.py)."""
    folder = tmp_path_factory.mktemp("references")
    previous = os.environ.get(REFERENCES_ENV)
    os.environ[REFERENCES_ENV] = str(folder)
    yield folder
    if previous is None:
        del os.environ[REFERENCES_ENV]
    else:
        os.environ[REFERENCES_ENV] = previous


@pytest.fixture(scope="session")
def misuse_errors(tmp_path_factory) -> list[dict]:
    """Each rank's error for every case of tests/mpi/misuse.py, all cases in one 2-rank job
    (tests/test_engine.py and tests/test_tensor_parallel.py check them)."""
    scratch = str(tmp_path_factory.mktemp("misuse"))
    return [r["errors"] for r in run_scenario("misuse", 2, "all", scratch, timeout=300)]


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

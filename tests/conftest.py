"""Reports every mpirun launch's wall time against its limit at the end of a pytest run."""

from tests.support.mpirun import LAUNCHES

# A launch's limit must be at least twice its slowest measured duration (docs/testing.md):
# one that used more than this share of it is named in the summary.
HEADROOM = 0.5


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

"""`hyparflow plan --auto` without network options: this machine's measured, or a default, said."""

import json

import pytest

from hyparflow import cli
from hyparflow.auto.network_default import DEFAULT_LINK, assumed_network
from hyparflow.simulate.network import Link
from tests.support.measure_models import save_uniform_costs


def _measured():
    return {"intra": {"latency": 1e-6, "bandwidth": 5e9}, "reduce_rate": 3e9}


def test_a_measured_link_serves_inside_nodes_and_the_default_between_them():
    network, line = assumed_network(_measured)
    assert network.intra == Link(1e-6, 5e9) and network.inter == DEFAULT_LINK
    assert network.reduce_rate == 3e9
    assert line.startswith("network: none given; measured this machine's")
    assert "1.00 us, 5.00 GB/s inside a node; between nodes assumed 2.00 us, 12.00 GB/s" in line


def test_where_measuring_fails_the_default_is_assumed_and_said():
    def failing():
        raise RuntimeError("network benchmark failed: mpirun: command not found\nmore")

    network, line = assumed_network(failing)
    assert network.intra == network.inter == DEFAULT_LINK
    assert "measuring this machine's failed (network benchmark failed: mpirun: command" in line
    assert "more" not in line and "assumed 2.00 us, 12.00 GB/s inside and between nodes" in line


def test_plan_help_shows_the_planner_and_its_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = capsys.readouterr().out
    for option in ("--auto", "--ranks", "--memory SIZE", "--measure-network", "--measure-steps"):
        assert option in text.partition("hyparflow plan --auto: the planner")[2], option


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_plan_auto_with_no_network_measures_this_machines(tmp_path, capsys):
    """The real probe: `mpirun` of two ranks, as --measure-network runs it; the pick spans
    two nodes, so the link between them is the default, and stderr says both."""
    path, saved = str(tmp_path / "costs.json"), str(tmp_path / "network.json")
    save_uniform_costs(path)
    argv = ["plan", "--auto", path, "--ranks", "4", "--batch", "8", "--nodes", "2"]
    assert cli.main([*argv, "--json", "--save-network", saved]) == 0
    captured = capsys.readouterr()
    assert "network: none given; measured this machine's (mpirun, 2 ranks)" in captured.err
    assert json.loads(captured.out)["pick"]["label"]
    with open(saved) as f:
        network = json.load(f)
    assert network["inter"] == {"latency": 2e-6, "bandwidth": 12e9}
    assert network["intra"] != network["inter"]


def test_layouts_over_the_budget_are_one_line_of_the_report():
    from hyparflow.auto.command import report
    from hyparflow.auto.search import Candidate, Estimate, search

    sizes = {(1, 4, 1): 3 << 30, (1, 2, 2): 5 << 30, (2, 2, 1): 1 << 30, (4, 1, 1): 1 << 29}
    layouts = [Candidate(p, r, t) for p, r, t in sizes]

    def estimate(c):
        if c.partitions == 4:
            raise ValueError("cannot split")
        return Estimate(1.0, sizes[c.partitions, c.replicas, c.tensor])

    text = report(search(layouts, estimate, 64, budget_bytes=2 << 30))
    assert "rejected 2: over the budget per rank (they need 3.00 GiB to 5.00 GiB)" in text
    assert "rejected 1: cannot split" in text and text.count("rejected") == 2

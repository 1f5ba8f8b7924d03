"""Many nodes: placement on the node map (pure), and training across 2 emulated nodes under a
real mpirun (scripts/emulated_nodes.sh): equality with Keras, shared memory within a node and
TCP on the loopback interface between nodes, and a node killed mid-epoch."""

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyparflow.callbacks.report import format_report
from hyparflow.callbacks.summary import load_summary
from hyparflow.comm.placement import crossings, place
from hyparflow.comm.topology import Grid
from tests.support import nodes
from tests.support.cases import Case, run_cases
from tests.support.mpirun import launch

TOLERANCE = 1e-5  # as tests/test_engine.py


# --- placement, without MPI ---------------------------------------------------------------------
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 4),
    st.booleans(),
)
def test_placement_keeps_tensor_groups_in_a_node_and_spreads_replicas(p, r, t, nodes, cyclic):
    grid = Grid(p, r, t)
    if grid.size % nodes or (grid.size // nodes) % t:
        return  # nodes of equal size holding whole tensor groups: the layouts users run
    per_node = grid.size // nodes
    node_of = [(i % nodes if cyclic else i // per_node) for i in range(grid.size)]
    order = place(node_of, grid)
    assert sorted(order) == list(range(grid.size))  # every rank takes exactly one place
    found = crossings(order, node_of, grid)
    assert found["tensor_groups"] == 0
    # a pipeline crosses nodes only as often as its length over a node's width makes it
    width = p * t
    if width % per_node == 0 or per_node % width == 0:
        assert found["pipeline_links"] == max(0, width // per_node - 1) * r * t
    # every stage's replicas span nodes once there are several of each
    assert found["replica_sets"] == (p * t if r > 1 and nodes > 1 else 0)
    if not cyclic:  # the launcher's block order is kept as it is
        assert order == list(range(grid.size))


@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([2, 4]),
    st.sampled_from([1, 2]),
    st.integers(1, 4),
    st.booleans(),
)
def test_expert_groups_stay_inside_a_node_wherever_a_node_holds_whole_groups(
    p, groups, experts, t, nodes, cyclic
):
    """An expert group (E consecutive replicas of a stage and shard) spans nodes only where a
    node cannot hold E whole pipelines: placement deals replicas node by node."""
    grid = Grid(p, groups * experts, t)
    if grid.size % nodes or (grid.size // nodes) % (p * t):
        return  # nodes of equal size holding whole pipelines
    per_node = grid.size // nodes
    node_of = [(i % nodes if cyclic else i // per_node) for i in range(grid.size)]
    found = crossings(place(node_of, grid), node_of, grid, experts=experts)
    if per_node % (experts * p * t) == 0:
        assert found["expert_groups"] == 0
    elif per_node < experts * p * t:  # a group is wider than a node: each one spans
        assert found["expert_groups"] == p * t * groups


def test_placement_of_uneven_nodes_leaves_no_rank_out():
    # 3 ranks per node, groups of 2: one group per node inside it, the odd ranks pair up
    order = place([0, 0, 0, 1, 1, 1], Grid(partitions=1, replicas=3, tensor=2))
    assert order == [0, 1, 3, 4, 2, 5]
    with pytest.raises(ValueError, match="cannot fill a grid of 4"):
        place([0, 0, 1], Grid(2, 2))


def test_plan_prints_the_node_of_each_rank(tmp_path, capsys):
    import keras

    from hyparflow.cli import main

    inputs = keras.Input((4,))
    x = keras.layers.Dense(8)(inputs)
    keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8)(x))).save(tmp_path / "m.keras")
    path = str(tmp_path / "m.keras")
    args = ["plan", path, "-p", "2", "-r", "2", "--hosts", "nodeA:2,nodeB:2"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Placement on 2 node(s)" in text
    rows = [line.split() for line in text.splitlines()[-4:]]
    assert rows == [
        ["0", "nodeA", "0", "0", "0"],
        ["1", "nodeA", "1", "0", "0"],
        ["2", "nodeB", "0", "1", "0"],
        ["3", "nodeB", "1", "1", "0"],
    ]
    assert main([*args, "--json"]) == 0
    placed = json.loads(capsys.readouterr().out)["placement"]
    assert [row["node"] for row in placed] == ["nodeA", "nodeA", "nodeB", "nodeB"]
    # round-robin hosts: the pipelines still stay inside a node
    assert main([*args[:-1], "nodeA:1,nodeB:1,nodeA:1,nodeB:1", "--json"]) == 0
    placed = json.loads(capsys.readouterr().out)["placement"]
    assert [(r["node"], r["stage"], r["replica"]) for r in placed] == [
        ("nodeA", 0, 0),
        ("nodeB", 0, 1),
        ("nodeA", 1, 0),
        ("nodeB", 1, 1),
    ]
    assert main([*args[:-1], "nodeA:2,nodeB:1"]) == 1
    assert "3 slots for 4 ranks" in capsys.readouterr().err


# --- across emulated nodes ----------------------------------------------------------------------
pytestmark_nodes = pytest.mark.skipif(
    nodes.skip_reason() is not None, reason=str(nodes.skip_reason())
)
HOSTS = "nodeA:2,nodeB:2"
# Open MPI's --map-by node deals ranks round-robin (0 and 2 on nodeA): hyparflow reorders them
ROUND_ROBIN = (*nodes.mpirun(HOSTS), "--map-by", "node")
CASES = [
    Case("mlp", "adam", "data", replicas=4),
    Case("mlp", "sgd", "model", partitions=4, microbatches=2, schedule="1f1b"),
    Case("mlp", "adam", "hybrid", partitions=2, replicas=2, microbatches=2),
    Case("wide_mlp", "adam", "model", partitions=2, tensor=2),
]
# what each case's grid must look like on 2 nodes of 2 (placement.crossings)
EXPECTED_CROSSINGS = {
    "mlp-adam-data-R4": {"tensor_groups": 0, "pipeline_links": 0, "replica_sets": 1},
    "mlp-sgd-model-P4-M2-1f1b": {"tensor_groups": 0, "pipeline_links": 1, "replica_sets": 0},
    "mlp-adam-hybrid-P2R2-M2": {"tensor_groups": 0, "pipeline_links": 0, "replica_sets": 2},
    "wide_mlp-adam-model-P2T2": {"tensor_groups": 0, "pipeline_links": 2, "replica_sets": 0},
}


@pytest.fixture(scope="module")
def across_nodes():
    """All cases in one launch on 2 emulated nodes x 2 ranks, ranks dealt round-robin."""
    return run_cases("nodes", 4, CASES, "cases", timeout=600, mpirun=ROUND_ROBIN)


@pytest.mark.mpi
@pytestmark_nodes
@pytest.mark.parametrize("case", CASES, ids=str)
def test_two_nodes_match_keras_with_tensor_groups_and_pipelines_inside_nodes(across_nodes, case):
    for r in across_nodes[case.id]:
        assert r["weights"] < TOLERANCE, (case.id, r["rank"], r["weights"])
        assert r["history"] < TOLERANCE, (case.id, r["rank"], r["history"])
        # the trainer's own grid: the host of each place, as its communicators see it
        hosts = r["grid_nodes"]
        assert sorted(hosts) == ["nodeA", "nodeA", "nodeB", "nodeB"]
        names = sorted(set(hosts))
        grid = Grid(case.partitions, case.replicas, case.tensor)
        found = crossings(range(4), [names.index(h) for h in hosts], grid)
        assert found == EXPECTED_CROSSINGS[case.id], (case.id, hosts)


@pytest.mark.mpi
@pytestmark_nodes
def test_shared_memory_inside_a_node_tcp_on_loopback_between_and_the_profiler_names_nodes(
    tmp_path,
):
    log_dir = str(tmp_path / "profile")
    run = launch("nodes", 4, "wiring", log_dir, timeout=300, mpirun=ROUND_ROBIN)
    assert run.returncode == 0, run.describe()
    hosts = [r["host"] for r in run.results]
    assert hosts == ["nodeA", "nodeB", "nodeA", "nodeB"]  # round-robin, as launched
    # the profiler's ranks are the grid's: rank r of the job is grid place r, placed by node
    profile = load_summary(os.path.join(log_dir, "profile.json"))
    assert [r["node"] for r in profile["ranks"]] == ["nodeA", "nodeA", "nodeB", "nodeB"]
    assert [(r["stage"], r["replica"]) for r in profile["ranks"]] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
    ]
    lines = format_report(profile).splitlines()  # `hyparflow report`: a node column
    assert lines[3].split()[:4] == ["rank", "node", "stage", "replica"], lines
    assert [row.split()[1] for row in lines[4:8]] == ["nodeA", "nodeA", "nodeB", "nodeB"], lines
    for rank, (result, stderr) in enumerate(zip(run.results, run.stderr, strict=True)):
        choices = nodes.btl_choices(stderr)
        assert {(peer, btl) for _, btl, peer, _ in choices if peer != rank} == {
            (p, "vader" if hosts[p] == hosts[rank] else "tcp") for p in range(4) if p != rank
        }, stderr[-2000:]
        assert result["tcp_peers"] and set(result["tcp_peers"]) == {"127.0.0.1"}

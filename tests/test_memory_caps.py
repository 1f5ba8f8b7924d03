"""Training under a per-rank memory cap (each rank in its own cgroup, tests/support/cgroup.py):
a model one process cannot train in the cap trains on four ranks built under hf.scope(), with
the loss of an uncapped process.

Every process runs under TensorFlow's pooled allocator (docs/testing.md, "Memory"): without it,
on a CPU where TensorFlow leaves oneDNN off, glibc's heap keeps freed blocks and a P=2 x T=2
rank crossed its cap. Each layout's cap is derived from the memory plan, not tuned: room for
its largest rank plus 35%, above what the cgroup holds before the model exists (imports,
MPI). The plan errs low by up to 17% on these ranks (what an engine rank grows outside
TensorFlow's allocator, docs/memory.md); with 15% the cap sat within 3% of a rank's peak and
CI's run crossed it.
One process needs 2.9x P=4's room (asserted >= 2.5, the issue's figure) and 2.4x P=2 x T=2's
(asserted >= 2.0: tensor shards still update after the whole backward).
hf.fit's default strategy under the caps: the planner reads each rank's room under its own
cgroup and picks a layout that fits (measured: P=2, peaks 1,155 and 1,279 MiB under a
1,673 MiB cap, where data parallelism's plan is 1,678 MiB of growth alone).

A subclassed model (no layer graph: no plan of its activations, no segments) under ZeRO-3:
each of its layers gathers its weights around its own call (docs/zero.md, "A model that is
not cut"), so four ranks train it in a cap that one process's need exceeds by SUBCLASSED_SPLIT,
the cap derived from that need, measured in the same run, not from the plan.

Not here: ZeRO-1 fitting where plain replicas cannot. Under hf.scope() plain replicas update
segment by segment and hold about one segment of gradients, while ZeRO-1 reduce-scatters every
gradient at once: at R=4 (2048 x 32) ZeRO-1's ranks grew 2,221-2,445 MiB against plain
replicas' 1,784-1,790 (docs/zero.md, "Memory"), so no cap can show it.
"""

import keras
import pytest

import hyparflow as hf
from hyparflow.auto.choose import CGROUP_HEADROOM
from tests.mpi.memory_checks import BATCH, layout, wide_mlp
from tests.support import cgroup
from tests.support.mpirun import POOLED_ALLOCATOR_ENV

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(cgroup.skip_reason() is not None, reason=str(cgroup.skip_reason())),
]

SHAPE = "2048,32"  # 134 M parameters, 512 MiB of weights; Adam
MIB = 2**20
MARGIN = 1.35  # above the plan, which measured 8-17% low on these ranks (module docstring)
# layout -> how many times its room one process must need (the premise)
SPLIT = {"4,1,1,params,scope": 2.5, "2,1,2,scope": 2.0}


def _predicted(spec: str) -> int:
    """The largest rank's predicted peak growth for `spec` (a hf.scope() model)."""
    width, depth = (int(v) for v in SHAPE.split(","))
    model = wide_mlp(width, depth, scope=True)
    return hf.memory_plan(model, layout(spec), batch_size=BATCH, whole_model=False).largest.total


SUBCLASSED = "1,4,1,zero3,subclassed,scope"
SUBCLASSED_SPLIT = 1.5  # one process needs 1.5x the room the cap leaves each rank


@pytest.fixture(scope="module")
def reference():
    """One uncapped process: its loss, and what its cgroup held beyond the training's growth."""
    run, (outcome,) = cgroup.launch_capped(
        "memory_checks", 1, "16G", "measure", "1,1,1", SHAPE, env=POOLED_ALLOCATOR_ENV
    )
    assert run.returncode == 0 and run.results[0], run.describe()
    result = run.results[0]
    return {**result, "base": outcome.peak - result["growth"], "total": outcome.peak}


@pytest.mark.parametrize("spec", SPLIT)
def test_one_process_is_refused_where_four_ranks_train_with_its_loss(reference, spec):
    room = int(MARGIN * _predicted(spec))
    cap = reference["base"] + room
    needs = reference["total"] - reference["base"]
    assert needs >= SPLIT[spec] * room, (needs / MIB, room / MIB)  # the premise
    run, (alone,) = cgroup.launch_capped(
        "memory_checks", 1, cap, "measure", "1,1,1,scope", SHAPE, env=POOLED_ALLOCATOR_ENV
    )
    # refused up front by the plan against the cgroup's limit, with the way out
    assert not alone.killed_for_memory and "MemoryError" in run.stderr[0], run.describe()
    assert "hf.memory_plan" in run.stderr[0] and "mpirun -np N" in run.stderr[0]
    run, outcomes = cgroup.launch_capped(
        "memory_checks", 4, cap, "measure", spec, SHAPE, env=POOLED_ALLOCATOR_ENV
    )
    assert run.returncode == 0, (spec, cap / MIB, outcomes, run.describe())
    for result, outcome in zip(run.results, outcomes, strict=True):
        assert outcome.peak <= cap and not outcome.killed_for_memory
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-4), spec


def test_model_is_deferred_in_the_plan():
    model = wide_mlp(64, 2, scope=True)
    assert hf.memory_plan(model, layout("2,1,1"), batch_size=BATCH).ranks[0].model_copy == 0
    keras.backend.clear_session()


def test_the_default_strategy_picks_a_layout_each_ranks_cap_holds(reference):
    """hf.fit's default strategy on a model built under hf.scope() whose data-parallel layout
    does not fit each rank's cgroup: the planner reads each rank's room under its own cap
    (auto/choose.py, `share_per_rank`), picks a layout that fits it, and trains with the loss
    of an uncapped process."""
    # room for a pipeline of two, of which the planner fills CGROUP_HEADROOM
    room = int(MARGIN * _predicted("2,1,1,params,scope") / CGROUP_HEADROOM)
    cap = reference["base"] + room
    assert _predicted("1,2,1,scope") > room  # the premise: plain replicas cannot fit
    run, outcomes = cgroup.launch_capped(
        "memory_checks", 2, cap, "measure", "auto,scope", SHAPE, env=POOLED_ALLOCATOR_ENV
    )
    assert run.returncode == 0, (cap / MIB, outcomes, run.describe())
    for result, outcome in zip(run.results, outcomes, strict=True):
        assert result["layout"] != [1, 2, 1] or result["sharding"], result  # not plain replicas
        assert outcome.peak <= cap and not outcome.killed_for_memory, (outcome, cap / MIB)
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-4), result


def test_a_subclassed_model_one_process_cannot_fit_trains_on_four_ranks_under_zero3():
    """Issue 65: the subclassed MLP, one uncapped process measured; then, in a cap that
    leaves each rank 1/SUBCLASSED_SPLIT of that process's need, one process is refused and
    four ranks with sharded weights train with its loss, each under the cap."""
    run, (outcome,) = cgroup.launch_capped(
        "memory_checks", 1, "16G", "measure", "1,1,1,subclassed", SHAPE, env=POOLED_ALLOCATOR_ENV
    )
    assert run.returncode == 0 and run.results[0], run.describe()
    alone = run.results[0]
    base = outcome.peak - alone["growth"]
    cap = base + int(alone["growth"] / SUBCLASSED_SPLIT)
    run, (capped,) = cgroup.launch_capped(
        "memory_checks",
        1,
        cap,
        "measure",
        "1,1,1,subclassed,scope",
        SHAPE,
        env=POOLED_ALLOCATOR_ENV,
    )
    assert not capped.killed_for_memory and "MemoryError" in run.stderr[0], run.describe()
    run, outcomes = cgroup.launch_capped(
        "memory_checks", 4, cap, "measure", SUBCLASSED, SHAPE, env=POOLED_ALLOCATOR_ENV
    )
    assert run.returncode == 0, (cap / MIB, outcomes, run.describe())
    for result, outcome in zip(run.results, outcomes, strict=True):
        assert outcome.peak <= cap and not outcome.killed_for_memory, (outcome, cap / MIB)
        assert result["loss"] == pytest.approx(alone["loss"], rel=1e-4), result

"""The memory plan: its arithmetic, its facts from Keras models, and its predictions against
peak resident growth measured under real mpirun; the cgroup fixture; the process's limit."""

import dataclasses
import sys
import warnings

import keras
import numpy as np
import pytest

import hyparflow as hf
from hyparflow import schedule
from hyparflow.memory import buffers, counts
from hyparflow.memory.limits import (
    CgroupRoom,
    cgroup_paths,
    cgroup_room,
    memory_limit,
    memory_room,
    parse_limit,
    share_per_rank,
)
from hyparflow.memory.slots import optimizer_slots
from tests.support import cgroup
from tests.support.mpirun import POOLED_ALLOCATOR_ENV, run_scenario

MIB = 2**20
TOLERANCE = 0.25
SHAPE = "2048,6"  # wide_mlp: 22 M parameters, 84 MiB of float32 weights


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_in_flight_is_the_engines_schedule(kind):
    for p in range(1, 6):
        for m in range(1, 9):
            actions = schedule.make_schedule(kind, p, m)
            for s in range(p):
                assert counts.in_flight(kind, p, m, s) == schedule.peak_in_flight(actions[s])


def test_interleaved_chunks_in_flight_are_the_engines_schedule():
    for p in range(2, 5):
        for m in range(1, 9):
            for v in (2, 3):
                actions = schedule.make_schedule("interleaved", p, m, virtual_stages=v)
                for s in range(p):  # one byte per chunk in flight: the (micro-batch, chunk) count
                    kept = counts.chunk_activation_bytes(actions[s], [(1, 0)] * v, samples=1)
                    assert kept == schedule.peak_in_flight(actions[s])
    one_f_one_b = schedule.make_schedule("1f1b", 2, 4)[0]
    assert counts.chunk_activation_bytes(one_f_one_b, [(10, 1)], 8, recompute=True) == (
        counts.activation_bytes(10, 1, 8, counts.in_flight("1f1b", 2, 4, 0), recompute=True)
    )


def test_arithmetic():
    assert counts.microbatch_size(64, 2, 4) == 8
    assert counts.activation_bytes(1000, 100, 8, 4) == 8 * 1100 * 4
    assert counts.activation_bytes(1000, 100, 8, 4, recompute=True) == 8 * (400 + 1000)
    assert counts.optimizer_bytes(1000, 2, replicas=4, shard_optimizer=True) == 500
    assert counts.optimizer_bytes(1000, 2, replicas=4) == 2000
    staged = buffers.StageFacts(
        2**28, 16, stages=4, replicas=1, microbatches=2, world=4, by_segment=True
    )
    assert buffers.held_gradients(staged, 2**28) == 2**25  # at most 8 segments
    replicated = dataclasses.replace(staged, replicas=2)
    assert buffers.held_gradients(replicated, 2**28) == 2**25
    assert buffers.step_buffers(replicated)["segment sum"] == 2**25
    # ZeRO-1 by segment: one segment's gradients, its slice updated, every slice variable kept
    sharded = buffers.step_buffers(
        dataclasses.replace(replicated, shard_optimizer=True), 2, sharded=True
    )
    assert "segment sum" not in sharded and sharded["flat gradients"] == buffers.BUCKET_BYTES
    assert sharded["slice copies"] == 2**27 + 2 * 2**24
    assert sharded["optimizer update"] == 3 * 2**24 // 2
    for other in ({"by_segment": False}, {"tensor": 2}, {"world": 1}):
        unsegmented = dataclasses.replace(staged, **other)
        assert buffers.held_gradients(unsegmented, 2**28) == 2**28
    one = buffers.StageFacts(400, 2, stages=1, replicas=1, microbatches=1, world=1)
    assert buffers.step_buffers(one) == {}  # plain Keras: no engine
    assert buffers.exchange_buffers([400, 800], 1, largest=10) == {"weights exchange": 1600}
    big = buffers.StageFacts(2**30, 8, stages=1, replicas=4, microbatches=1, world=4, largest=2**27)
    assert buffers.step_buffers(big, 2) == {  # chunked gradients, update in groups
        "flat gradients": buffers.BUCKET_BYTES,
        "optimizer update": 3 * 2**27 // 2,
    }
    sharded = buffers.step_buffers(big, 2, sharded=True)
    assert sharded["optimizer update"] == 3 * 2**28 // 2 and sharded["slice copies"] == 3 * 2**28


def test_optimizer_slots():
    assert optimizer_slots(keras.optimizers.Adam()) == 2
    assert optimizer_slots(keras.optimizers.SGD()) == 0
    assert optimizer_slots(keras.optimizers.SGD(momentum=0.9)) == 1
    assert optimizer_slots(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())) == 2
    assert optimizer_slots(None) == 0


def _model(optimizer="adam"):
    x = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(x)
    h = keras.layers.Dense(32, activation="relu")(h)
    model = keras.Model(x, keras.layers.Dense(4)(h), name="small")
    model.compile(optimizer, "mse")
    return model


def test_plan_counts_weights_slots_and_shards():
    model = _model()
    whole = model.count_params() * 4
    one = hf.memory_plan(model, "data", batch_size=8, runtime=False)
    (rank,) = one.ranks
    assert (rank.weights, rank.gradients, rank.optimizer, rank.model_copy) == (
        whole,
        whole,
        2 * whole,
        0,
    )
    assert rank.activations == 8 * 4 * (16 + 32 + 32 + 4)  # inputs and every layer's output
    pipe = hf.memory_plan(model, hf.Strategy("model", partitions=2), batch_size=8)
    assert sum(r.weights for r in pipe.ranks) == whole
    assert all(r.weights + r.model_copy == whole for r in pipe.ranks)
    split = hf.memory_plan(model, hf.Strategy("data", replicas=1, tensor=2), batch_size=8)
    layout = hf.partition(model, 1, tensor=2).tensor_layouts[0]
    assert split.ranks[0].weights == sum(layout.bytes_per_rank())
    text = split.summary(print_fn=None)
    assert "Memory plan for 'small'" in text and "total MiB" in text
    assert split.to_dict()["largest_bytes"] == split.largest.total


@pytest.mark.parametrize(
    "fields",
    [
        {"partitions": 2, "replicas": 3, "microbatches": 2},
        {"partitions": 1, "replicas": 4, "tensor": 2, "shard_optimizer": True},
        {"partitions": 2, "replicas": 3, "tensor": 2, "shard_gradients": True},
    ],
)
def test_the_planners_plans_reuse_splits_and_keep_the_largest_rank(fields):
    """`splits` and `every_replica=False` (the planner's) give the same largest rank, for an
    ordinary build (rank 0 writes the saved state) and for one under hf.scope()."""
    kind = "hybrid" if fields["partitions"] > 1 else "data"
    for model in (_model(), _scoped_model()):
        full = hf.memory_plan(model, hf.Strategy(kind, **fields), batch_size=12)
        splits = {}
        for _ in range(2):  # the second reads the split the first made
            quick = hf.memory_plan(
                model, hf.Strategy(kind, **fields), 12, splits=splits, every_replica=False
            )
            assert quick.largest.total == full.largest.total
            assert len([k for k in splits if k not in ("sizes", "tables")]) == 1  # made once
        grid = fields["partitions"] * fields.get("tensor", 1)
        assert len(quick.ranks) == 2 * grid < len(full.ranks)


def _scoped_model():
    with hf.scope():
        return _model()


def test_interleaved_ranks_hold_their_chunks_and_each_chunks_micro_batches():
    x = keras.Input((16,))
    h = x
    for width in (64, 32, 32, 8):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = keras.Model(x, keras.layers.Dense(4)(h), name="deeper")
    model.compile("adam", "mse")
    whole = model.count_params() * 4
    kwargs = dict(partitions=2, microbatches=4, balance="layers")
    chunked = hf.Strategy("model", schedule="interleaved", virtual_stages=2, **kwargs)
    plan = hf.memory_plan(model, chunked, batch_size=16, runtime=False)
    assert "interleaved (v=2)" in plan.summary(print_fn=None)
    assert sum(r.weights for r in plan.ranks) == whole
    assert all(r.weights + r.model_copy == whole for r in plan.ranks)
    chunks = hf.partition(model, 4, "layers").stages
    assert plan.ranks[0].weights == 4 * sum(
        int(v.numpy().size) for c in (chunks[0], chunks[2]) for v in c.model.weights
    )
    plain = hf.memory_plan(model, hf.Strategy("model", schedule="1f1b", **kwargs), 16)
    assert plan.ranks[0].activations != plain.ranks[0].activations


def test_sharded_optimizer_divides_by_replicas():
    model = _model()
    plain = hf.memory_plan(model, hf.Strategy("data", replicas=4), batch_size=8)
    zero = hf.memory_plan(model, hf.Strategy("data", replicas=4, shard_optimizer=True), 8)
    assert zero.ranks[0].optimizer * 4 == pytest.approx(plain.ranks[0].optimizer, abs=4)


def test_sharded_gradients_hold_one_segment_and_the_slices_of_the_sums():
    """ZeRO-2 cuts the stage into segments (at least two) and sums micro-batches into slices:
    the gradients held are one segment's, the running sum a segment plus a slice."""
    model = _model()
    options = dict(replicas=4, microbatches=2, shard_optimizer=True)
    zero = hf.memory_plan(model, hf.Strategy("data", **options), batch_size=8).ranks[0]
    zero2 = hf.memory_plan(
        model, hf.Strategy("data", shard_gradients=True, **options), batch_size=8
    ).ranks[0]
    assert zero2.optimizer == zero.optimizer
    assert zero2.gradients == pytest.approx(zero.gradients / 2, abs=4)  # one of two segments
    assert zero2.step_buffers["gradient sum"] == pytest.approx(
        zero.gradients / 2 + zero.gradients / 4, abs=8
    )
    assert "sharded optimizer and gradients" in hf.memory_plan(
        model, hf.Strategy("data", shard_gradients=True, **options), batch_size=8
    ).summary(print_fn=None)


def test_sharded_weights_hold_slices_under_scope_and_gather_a_segment():
    """ZeRO-3: a hf.scope() model's rank holds 1/R of its dense weights, gathers one segment's
    (twice: received, read out) for each call and keeps its slices after the fit; an ordinary
    build holds them whole from its build; an embedding table stays whole."""
    with hf.scope():
        tokens = keras.Input((4,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(50, 8)(tokens))
        h = keras.layers.Dense(32, activation="relu")(h)
        model = keras.Model(tokens, keras.layers.Dense(4)(h), name="small")
        model.compile("adam", "mse")
    table = 50 * 8 * 4
    dense = (32 * 32 + 32 + 32 * 4 + 4) * 4
    options = dict(replicas=4, shard_optimizer=True, shard_gradients=True)
    zero2 = hf.memory_plan(model, hf.Strategy("data", **options), batch_size=8).ranks[0]
    zero3 = hf.memory_plan(
        model, hf.Strategy("data", shard_weights=True, **options), batch_size=8
    ).ranks[0]
    assert zero2.weights == table + dense
    assert zero3.weights == pytest.approx(table + dense / 4, abs=16)  # a slice's padding
    assert zero3.exchange == {}
    assert zero3.step_buffers["gathered weights"] == 2 * zero3.gradients
    assert "parameter broadcast" not in zero3.step_buffers
    ordinary = hf.memory_plan(
        model, hf.Strategy("data", shard_weights=True, **options), 8, whole_model=True
    )
    assert ordinary.ranks[0].weights == table + dense
    assert "sharded optimizer, gradients and weights" in ordinary.summary(print_fn=None)


def test_a_subclassed_model_under_zero3_is_planned_a_layer_at_a_time():
    """Its layers gather their weights around their own calls and reduce-scatter their
    gradients in the backward: a rank holds its gradients' slices and one layer's whole
    gradient, and gathers one layer (twice: received, read out) and the next one ahead, not
    the whole model."""
    from tests.mpi.memory_checks import wide_mlp

    model = wide_mlp(256, 4, subclassed=True)
    largest = 256 * 256 * 4
    total = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    rank = hf.memory_plan(model, hf.Strategy("data", replicas=4, shard_weights=True), 8).ranks[0]
    assert rank.gradients == pytest.approx(total / 4 + largest, abs=8)
    assert rank.step_buffers["gathered weights"] == 3 * largest
    zero2 = hf.memory_plan(model, hf.Strategy("data", replicas=4, shard_gradients=True), 8)
    assert zero2.ranks[0].gradients == total  # not cut: whole until the backward ends
    keras.backend.clear_session()


def test_a_model_with_its_own_train_step_is_planned_as_one_segment():
    """Its own tape makes whole gradients, and under ZeRO-3 its step gathers the whole model
    (engine/custom_step.py): the plan holds one segment where the same layer graph has two."""
    from tests.support.custom_steps import GuideStep, build

    def planned(kind):
        model = build(kind)
        strategy = hf.Strategy("data", replicas=2, shard_weights=True, update_by_segment=True)
        return hf.memory_plan(model, strategy, batch_size=8).ranks[0]

    graph, own = planned(keras.Model), planned(GuideStep)
    assert own.gradients == pytest.approx(2 * graph.gradients, abs=8)  # all, not a segment
    assert own.step_buffers["gathered weights"] == 2 * own.gradients  # the whole model


def test_cli_memory_plan_takes_the_sharding_flags(tmp_path, capsys):
    from hyparflow.cli import main

    path = str(tmp_path / "small.keras")
    _model().save(path)
    argv = [
        "plan",
        path,
        "-p",
        "1",
        "-r",
        "2",
        "--memory",
        "--batch-size",
        "8",
        "--shard-gradients",
    ]
    assert main(argv) == 0
    assert "sharded optimizer and gradients" in capsys.readouterr().out
    assert main([*argv[:-1], "--shard-weights"]) == 0
    assert "sharded optimizer, gradients and weights" in capsys.readouterr().out


def test_cli_prints_the_memory_plan(tmp_path, capsys):
    from hyparflow.cli import main

    path = str(tmp_path / "small.keras")
    _model().save(path)
    assert main(["plan", path, "-p", "2", "--memory", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "Memory plan for 'small'" in out and "P=2 x R=1 x T=1" in out


def test_cli_plans_a_trained_keras_hub_file_without_keras_skipping_its_optimizer(tmp_path):
    """keras_hub's tasks compile themselves when loaded, with an unbuilt optimizer: Keras then
    warns that it skipped the saved slots, which the plan never reads (issue 64)."""
    from hyparflow.cli import main
    from tests.support import hub_zoo

    path = str(tmp_path / "gpt2.keras")
    model = hub_zoo.compiled("GPT2")
    model.fit(*hub_zoo.data("GPT2", model), batch_size=8, verbose=0)  # its slots are saved
    model.save(path)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert main(["plan", path, "-p", "2", "--memory", "--batch-size", "8"]) == 0
    messages = [str(w.message) for w in warned]
    assert not [m for m in messages if "Skipping variable loading" in m], messages


def test_memory_limit_reads_v1_and_v2(tmp_path):
    v1 = tmp_path / "memory" / "jobs" / "7"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("1073741824\n")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/jobs/7\n0::/\n")
    assert memory_limit(str(tmp_path), str(proc)) == 2**30
    v2 = tmp_path / "v2"
    (v2 / "user").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "user" / "memory.max").write_text("max\n")
    (v2 / "memory.max").write_text("536870912\n")
    proc.write_text("0::/user\n")
    assert memory_limit(str(v2), str(proc)) == 2**29  # an ancestor's limit binds
    assert cgroup_paths("0::/a\n") == (None, "/a") and parse_limit("max") is None


def test_memory_room_is_the_tightest_limit_minus_its_usage(tmp_path):
    job = tmp_path / "memory" / "jobs" / "7"
    job.mkdir(parents=True)
    (job / "memory.limit_in_bytes").write_text("1073741824\n")
    (job / "memory.usage_in_bytes").write_text("268435456\n")  # 1 GiB limit, 256 MiB used
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text("17179869184\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/jobs/7\n0::/\n")
    assert memory_room(str(tmp_path), str(proc)) == 768 * MIB
    rank = job / "rank1"  # a cgroup per rank inside the job's, without a limit of its own
    rank.mkdir()
    (rank / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (rank / "memory.usage_in_bytes").write_text("1048576\n")
    proc.write_text("4:memory:/jobs/7/rank1\n0::/\n")
    assert cgroup_room(str(tmp_path), str(proc)) == CgroupRoom(
        "/jobs/7/rank1", "/jobs/7", 768 * MIB
    )
    (job / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_room(str(tmp_path), str(proc)) is None  # no limit anywhere


@pytest.mark.parametrize(
    ("found", "share"),
    [
        ([(0, CgroupRoom("/job", "/job", 900))] * 3, 300),  # one cgroup for the node's ranks
        ([(0, CgroupRoom("/job/r0", "/job", 900)), (0, CgroupRoom("/job/r1", "/job", 900))], 450),
        ([(0, CgroupRoom("/r0", "/r0", 900)), (0, CgroupRoom("/r1", "/r1", 500))], 500),  # own
        ([(0, CgroupRoom("/job", "/job", 900)), (1, CgroupRoom("/job", "/job", 600))], 600),
        ([(0, CgroupRoom("/job", "/job", 900)), (0, None)], 900),  # the other has no limit
        ([(0, None), (1, None)], None),
    ],
)
def test_each_rank_gets_its_cgroups_room_shared_by_the_ranks_inside_it(found, share):
    """A Slurm job's ranks share its cgroup's room; ranks with a cgroup each do not; the
    planner's budget is the least share over the ranks (auto/choose.py)."""
    assert share_per_rank(found) == share


@pytest.mark.skipif(cgroup.skip_reason() is not None, reason=str(cgroup.skip_reason()))
def test_cgroup_cap_kills_only_what_exceeds_it():
    allocate = "import numpy as np, sys; np.ones(int(sys.argv[1]), np.uint8).sum()"
    over = cgroup.run_capped("100M", [sys.executable, "-c", allocate, str(200 * MIB)])
    under = cgroup.run_capped("100M", [sys.executable, "-c", allocate, str(50 * MIB)])
    assert over.killed_for_memory, over
    assert under.returncode == 0 and not under.killed_for_memory, under
    assert 50 * MIB <= under.peak < 100 * MIB


@pytest.mark.mpi
@pytest.mark.parametrize(
    "ranks, spec",
    [(1, "1,1,1"), (2, "2,1,1"), (2, "2,1,1,interleaved"), (4, "2,2,1")],
    ids=["keras", "pipeline-2", "interleaved-2", "hybrid-2x2"],
)
def test_prediction_within_25_percent_of_measured_growth(ranks, spec):
    """The plan counts what TensorFlow's pooled (BFC) CPU allocator holds, the allocator it uses
    where it turns oneDNN on (CPUs with AVX-512 VNNI or newer). Elsewhere its default allocator is
    glibc's malloc, which keeps freed blocks: one process grew 604-630 MiB there against 361
    under BFC (docs/memory.md). The ranks run under BFC so that the test holds on any CPU."""
    for result in run_scenario(
        "memory_checks", ranks, "measure", spec, SHAPE, env=POOLED_ALLOCATOR_ENV
    ):
        error = result["predicted"] / result["growth"] - 1
        assert abs(error) < TOLERANCE, (spec, result["line"], result["growth"] / MIB)


@pytest.mark.mpi
def test_hf_scope_ranks_grow_by_issue_29s_ratios_of_one_process():
    """A weight-heavy MLP (134 M parameters, Adam) built under hf.scope(): P=4's largest rank
    grows by at most 0.35x what one process grows (measured 0.28; 0.37 before stages updated
    segment by segment), and each of R=2's ranks by at most 1.1x (measured 1.00; 1.24 with the
    update after the whole backward, which an ordinary build still uses: docs/memory.md)."""
    shape = "2048,32"
    (alone,) = run_scenario("memory_checks", 1, "measure", "1,1,1", shape)
    for spec, ratio in (("4,1,1,params,scope", 0.35), ("1,2,1,scope", 1.1)):
        ranks = run_scenario(
            "memory_checks", 2 if spec.startswith("1,2") else 4, "measure", spec, shape
        )
        largest = max(r["growth"] for r in ranks)
        assert largest <= ratio * alone["growth"], (spec, largest / MIB, alone["growth"] / MIB)
        assert all(r["loss"] == pytest.approx(alone["loss"], rel=1e-5) for r in ranks), spec

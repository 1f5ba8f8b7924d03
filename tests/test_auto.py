"""`strategy="auto"` in hf.fit (hyparflow/auto/choose.py): which strategies leave the layout to
the planner, which fields it keeps, and, on 2 ranks under mpirun (tests/mpi/auto_fit.py), the
pick agreed, exact against Keras, within a budget, refused when nothing fits."""

import keras
import numpy as np
import pytest

import hyparflow as hf
from hyparflow.auto.choose import _keeping_user_fields, why_unplannable
from hyparflow.auto.search import candidates
from hyparflow.data.sources import fit_sources, input_shapes, nominal_batch_size
from tests.support.mpirun import launch
from tests.support.tolerances import TOLERANCE as HUB_TOLERANCE
from tests.support.zoo_only import full_zoo

TOLERANCE = 1e-5


def test_only_an_auto_strategy_without_a_layout_is_open():
    assert hf.Strategy().leaves_layout_open()
    assert hf.Strategy(shard_optimizer=True, memory_per_rank="2GiB").leaves_layout_open()
    for given in (
        hf.Strategy("data"),
        hf.Strategy(partitions=2),
        hf.Strategy(replicas=2),
        hf.Strategy(tensor=2),
        hf.Strategy("model"),
    ):
        assert not given.leaves_layout_open(), given


def test_memory_per_rank_takes_bytes_or_a_size():
    assert hf.Strategy(memory_per_rank="1.5GiB").memory_per_rank == int(1.5 * 2**30)
    assert hf.Strategy(memory_per_rank=4096).memory_per_rank == 4096
    with pytest.raises(ValueError, match="not a size"):
        hf.Strategy(memory_per_rank="lots")
    with pytest.raises(ValueError, match="memory_per_rank"):
        hf.Strategy(memory_per_rank=0)


def test_the_search_keeps_the_fields_the_user_set():
    layouts = candidates(4, 32, layers=8)
    kept = _keeping_user_fields(layouts, hf.Strategy(shard_optimizer=True, microbatches=2))
    assert kept and all(c.shard_optimizer and c.microbatches == 2 for c in kept)
    assert {c.partitions for c in kept} == {1, 2}  # ZeRO-1 needs replicas: no P4 R1
    assert _keeping_user_fields(layouts, hf.Strategy()) == layouts
    one_f_one_b = _keeping_user_fields(layouts, hf.Strategy(schedule="1f1b"))
    assert {c.partitions for c in one_f_one_b} == {1, 2, 4}  # data parallelism stays in
    assert all(c.schedule == "1f1b" for c in one_f_one_b if c.partitions > 1)
    # ZB-H1 is priced but not searched unless asked for (no faster than 1F1B as measured)
    assert "zero_bubble" not in {c.schedule for c in layouts}
    asked = candidates(4, 32, layers=8, schedules=("zero_bubble",))
    zero_bubble = _keeping_user_fields(asked, hf.Strategy(schedule="zero_bubble"))
    assert {c.schedule for c in zero_bubble if c.partitions > 1} == {"zero_bubble"}
    # interleaved likewise, with two model chunks a stage (or the virtual stages asked for)
    asked = candidates(4, 32, layers=8, schedules=("interleaved",), virtual_stages=3)
    interleaved = _keeping_user_fields(asked, hf.Strategy(schedule="interleaved"))
    assert {(c.schedule, c.virtual_stages) for c in interleaved if c.partitions > 1} == {
        ("interleaved", 3)
    }


def test_what_cannot_be_timed_is_named():
    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert "not a layer graph" in why_unplannable(Subclassed())
    with hf.scope():  # planned layer by layer (tests/test_by_layer.py)
        inputs = keras.Input((4,))
        deferred = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    assert why_unplannable(deferred) is None
    inputs = keras.Input((4,))
    assert why_unplannable(keras.Model(inputs, keras.layers.Dense(2)(inputs))) is None


def test_the_planner_reads_the_batch_and_the_input_shapes_from_the_data():
    import tensorflow as tf

    def source(x, y=None, batch_size=None):
        return fit_sources((x, y, None), None, {}, batch_size=batch_size, seed=0, strategy=None)[0]

    x, y = np.zeros((10, 3, 4), "float32"), np.zeros((10, 1), "float32")
    arrays = source(x, y, batch_size=5)
    assert nominal_batch_size(arrays) == 5 and input_shapes(arrays) == (3, 4)
    assert input_shapes(source([x, x[:, 0]], y)) == [(3, 4), (4,)]
    named = {"mask": x[:, 0] > 0, "values": x}  # keras_hub's kind of data: by input name
    assert input_shapes(source(named, y)) == {"mask": (4,), "values": (3, 4)}
    assert nominal_batch_size(source(x, y)) == 32  # Keras's default
    partial = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)  # no static batch size
    assert nominal_batch_size(source(partial)) is None and input_shapes(source(partial)) is None
    assert nominal_batch_size(source(partial.unbatch().batch(4, drop_remainder=True))) == 4


def test_a_model_taking_a_dict_is_timed_at_the_shapes_of_its_data_by_name():
    from hyparflow.partitioner import profile
    from hyparflow.partitioner.graph import build_graph

    values, mask = keras.Input((None, 4), name="values"), keras.Input((None,), name="mask")
    pooled = keras.layers.GlobalAveragePooling1D()(values, mask=keras.ops.cast(mask, "bool"))
    model = keras.Model({"values": values, "mask": mask}, keras.layers.Dense(2)(pooled))
    graph = build_graph(model)
    sample = profile.make_sample(graph, input_shape={"mask": (6,), "values": (6, 4)}, batch_size=3)
    order = [graph.tensors[t].keras_tensor.name for t in graph.inputs]
    wanted = [(3, 6, 4) if name == "values" else (3, 6) for name in order]
    assert [tuple(s.shape) for s in sample] == wanted
    with pytest.raises(ValueError, match="no shape for the model's inputs"):
        profile.make_sample(graph, input_shape={"values": (6, 4)})
    with pytest.raises(ValueError, match="unknown dimensions"):  # what the planner met before
        profile.make_sample(graph)


@pytest.fixture(scope="module")
def two_ranks():
    run = launch("auto_fit", 2, timeout=400)
    assert run.returncode == 0 and all(run.results), run.describe()
    return run


@pytest.mark.mpi
def test_every_rank_trains_the_same_pick_exactly(two_ranks):
    opened = [r["open"] for r in two_ranks.results]
    assert len({o["strategy"] for o in opened}) == 1, opened
    for o in opened:
        assert o["weights"] < TOLERANCE and o["history"] < TOLERANCE, o
        assert o["evaluate_same_trainer"] and o["planned_once"], o
    line = next(x for x in two_ranks.stdout[0].splitlines() if x.startswith("hyparflow auto:"))
    assert opened[0]["label"] in line and "samples/s" in line and "planned in" in line, line
    assert not any("hyparflow auto" in out for out in two_ranks.stdout[1:])


@pytest.mark.mpi
def test_a_budget_that_rules_out_data_parallelism_is_kept(two_ranks):
    for r in two_ranks.results:
        budget = r["budget"]
        assert budget["data_bytes"] > budget["budget"] >= budget["bytes"], budget
        assert budget["label"] != "P1 R2 T1 M1" and budget["weights"] < TOLERANCE, budget


@pytest.mark.mpi
def test_a_model_built_under_hf_scope_is_planned_and_trains_exactly(two_ranks):
    """Issue 66: it was left data parallel ("holds no weights to time"), the one layout that
    holds all of it; now timed layer by layer, its pick fits the budget."""
    picks = [r["deferred"] for r in two_ranks.results]
    assert len({p["strategy"] for p in picks}) == 1, picks
    for p in picks:
        assert p["data_bytes"] > p["budget"] >= p["bytes"], p
        assert p["label"] != "P1 R2 T1 M1" and p["held"] > 0, p
        assert p["weights"] < TOLERANCE and p["history"] < TOLERANCE, p
    lines = two_ranks.stdout[0].splitlines()
    assert any(line.startswith(f"hyparflow auto: {picks[0]['label']}") for line in lines)
    assert not any("hf.scope()" in line for line in lines), lines


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_keras_hub_causal_lms_are_planned_at_their_data_shapes_and_train_exactly():
    """Issue 66: GPT-2's and Llama's inputs {"token_ids", "padding_mask"} have unknown
    lengths; the default strategy times them at the data's and names a pick, not a fallback.
    Llama under `make zoo` only (the same dict of unknown lengths as GPT-2's)."""
    families = ("GPT2", "Llama") if full_zoo() else ("GPT2",)
    run = launch("hub_auto", 2, *families, timeout=800)
    assert run.returncode == 0 and all(run.results), run.describe()
    for result in run.results:
        assert sorted(result) == sorted(families), result
        for family, found in result.items():
            assert found["label"], (family, found)
            assert found["excess"] < 1 and found["history"] < HUB_TOLERANCE, (family, found)
    said = [x for x in run.stdout[0].splitlines() if x.startswith("hyparflow auto:")]
    assert len(said) == len(families), said
    assert not any("data parallel over" in x for x in said), said


@pytest.mark.mpi
def test_a_budget_nothing_fits_is_refused_on_every_rank(two_ranks):
    refused = [r["budget"]["refused"] for r in two_ranks.results]
    assert all(r["budget"]["timed_once"] for r in two_ranks.results)
    assert "no layout fits 1.0 MiB per rank" in refused[0], refused
    assert refused[1].startswith("RemoteRankError") and "no layout fits" in refused[1], refused


@pytest.mark.mpi
def test_what_cannot_be_planned_stays_data_parallel(two_ranks):
    for r in two_ranks.results:  # a subclassed model; a Dataset without a static batch size;
        # variable-length inputs given as a dict (no shape to time them at)
        for layout in (r["subclassed"], r["unknown_batch"], r["untimeable"]):
            assert "kind='data'" in layout and "replicas=2" in layout, r
    said = [x for x in two_ranks.stdout[0].splitlines() if x.startswith("hyparflow auto: data")]
    assert len(said) == 1 and "it could not be timed: ValueError" in said[0], said


def test_the_planner_times_a_keras_hub_causal_lm_from_its_data_shapes():
    """Before issue 64 the default strategy said a keras_hub causal LM "could not be timed ...
    pass input_shape=(...)", which hf.fit does not take: its data is a dict, its embedding's
    gradients row slices, its targets one class per position."""
    from hyparflow.auto.planner_costs import with_planner_costs
    from hyparflow.partitioner.graph import build_graph
    from hyparflow.simulate.measure import measure_model
    from tests.support import hub_zoo

    model = hub_zoo.compiled("GPT2")
    x, _ = hub_zoo.data("GPT2", model)
    shapes = {name: array.shape[1:] for name, array in x.items()}
    costs = measure_model(model, (2, 4), shapes, fit_batch_sizes=(), repeats=(1, 1))
    assert [layer.name for layer in costs.layers] == [n.name for n in build_graph(model).nodes]
    priced = with_planner_costs(costs, model, 2, shapes, 2, 1)  # the tensor shares, timed
    assert any(layer.tensor.split_bytes > 0 for layer in priced.layers)

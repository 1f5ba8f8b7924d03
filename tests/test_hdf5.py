"""hf.data.HDF5: shard-only reads, the in-memory batch order, errors, and 2-rank training."""

import sys

import h5py
import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyparflow.data import HDF5, ArraySource, split_bounds
from hyparflow.data.hdf5 import Rows, read_rows
from tests.support.compare import relative_difference
from tests.support.models import compiled, data, sample_weights
from tests.support.mpirun import run_scenario

TOLERANCE = 1e-5
GIB = 1 << 30
FEATURES = 1024  # rows of 4 KiB: 262,144 rows make the 1 GiB file


def _write_small(path):
    """The arrays of tests.support.models.data for "mlp" and "multi_io", plus sample ids."""
    x, y = data("mlp")
    mx, my = data("multi_io")
    with h5py.File(path, "w") as f:
        f["mlp/x"], f["mlp/y"], f["mlp/w"] = x, y, sample_weights(len(x))
        f["multi/a"], f["multi/b"] = mx["a"], mx["b"]
        f["multi/regression"], f["multi/classes"] = my["regression"], my["classes"]
        f["ids"] = np.arange(len(x))
        f["short"] = np.arange(len(x) - 1)
        f["scalar"] = 3.0
    return path


@pytest.fixture
def small_file(tmp_path):
    return _write_small(tmp_path / "small.h5")


def _equal(a, b) -> bool:
    flat_a, flat_b = keras.tree.flatten(a), keras.tree.flatten(b)
    return len(flat_a) == len(flat_b) and all(
        (p is None and q is None) or np.array_equal(np.asarray(p), np.asarray(q))
        for p, q in zip(flat_a, flat_b, strict=True)
    )


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_and_shards_equal_in_memory_arrays(small_file, shuffle):
    x, y = data("mlp")
    w = sample_weights(len(x))
    ours = HDF5(small_file, x="mlp/x", y="mlp/y", sample_weight="mlp/w").as_source(
        batch_size=16, shuffle=shuffle, seed=3
    )
    theirs = ArraySource(x, y, w, batch_size=16, shuffle=shuffle, seed=3)
    assert len(ours) == len(theirs) == 5
    for epoch in range(2):
        for a, b in zip(ours.epoch(epoch), theirs.epoch(epoch), strict=True):
            assert a.size == b.size
            for replica in range(3):  # uneven shards, as the engine cuts them
                start, stop = split_bounds(a.size, 3, replica)
                got = [None if r is None else r[0 : stop - start] for r in a.part(start, stop)]
                assert _equal(got, b.part(start, stop))


def test_shuffle_covers_each_sample_once_per_epoch(small_file):
    source = HDF5(small_file, x="ids").as_source(batch_size=16, shuffle=True, seed=11)
    orders = []
    for epoch in range(3):
        seen = []
        for batch in source.epoch(epoch):
            for replica in range(2):
                start, stop = split_bounds(batch.size, 2, replica)
                x, y, sw = batch.part(start, stop)
                assert y is None and sw is None
                seen.extend(x[:].tolist())
        assert sorted(seen) == list(range(70))
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]


def test_multi_input_structures(small_file):
    mx, my = data("multi_io")
    reader = HDF5(small_file, x={"a": "multi/a", "b": "multi/b"}, y=["multi/classes"])
    x, y, sw = reader.read(np.array([5, 2, 9]))
    assert set(x) == {"a", "b"} and sw is None
    np.testing.assert_array_equal(x["b"], mx["b"][[5, 2, 9]])
    np.testing.assert_array_equal(y[0], my["classes"][[5, 2, 9]])


class CountingDataset:
    """An h5py-like dataset that records every read."""

    def __init__(self, array):
        self.array, self.reads = array, []
        self.shape, self.dtype, self.name = array.shape, array.dtype, "/counting"

    def __getitem__(self, key):
        self.reads.append(key)
        return self.array[key]


def test_rows_read_only_when_sliced_and_only_their_rows():
    dataset = CountingDataset(np.arange(100.0).reshape(50, 2))
    rows = Rows(dataset, np.array([40, 3, 7, 8]))
    assert dataset.reads == [] and rows.shape == (4, 2) and len(rows) == 4
    np.testing.assert_array_equal(rows[1:3], [[6, 7], [14, 15]])
    np.testing.assert_array_equal(np.asarray(rows)[:, 0], [80, 6, 14, 16])
    # fancy reads are increasing (h5py's rule); contiguous ranges are one slice
    assert [list(np.asarray(k)) for k in dataset.reads] == [[3, 7], [3, 7, 8, 40]]
    Rows(dataset, np.array([10, 11, 12]))[:]
    assert dataset.reads[-1] == slice(10, 13)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 29), unique=True, max_size=30))
def test_read_rows_keeps_the_requested_order(tmp_path_factory, indices):
    path = tmp_path_factory.getbasetemp() / "rows.h5"
    if not path.exists():
        with h5py.File(path, "w") as f:
            f.create_dataset("d", data=np.arange(60).reshape(30, 2), chunks=(4, 2))
    with h5py.File(path, "r") as f:
        got = read_rows(f["d"], np.array(indices, dtype=np.int64))
    np.testing.assert_array_equal(got, np.arange(60).reshape(30, 2)[indices].reshape(-1, 2))


def test_missing_dataset_names_the_available_ones(small_file):
    with pytest.raises(ValueError, match=r"'images' does not exist.*'mlp/x'"):
        HDF5(small_file, x="images", y="mlp/y")
    with pytest.raises(ValueError, match="'multi' is not a dataset"):
        HDF5(small_file, x="multi")
    with pytest.raises(ValueError, match="'scalar' .* is a scalar"):
        HDF5(small_file, x="scalar")


def test_datasets_of_different_lengths(small_file):
    with pytest.raises(ValueError, match=r"different numbers of rows.*/short': 69"):
        HDF5(small_file, x="mlp/x", y="short")


def test_missing_h5py_names_the_extra(small_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)  # makes `import h5py` fail
    with pytest.raises(ImportError, match=r"pip install hyparflow\[io\]"):
        HDF5(small_file, x="mlp/x")


def test_one_process_keras_fit_matches_arrays(small_file):
    x, y = data("mlp")
    reference = compiled("mlp", "sgd")
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = compiled("mlp", "sgd")
    batches = HDF5(small_file, x="mlp/x", y="mlp/y").as_keras(batch_size=16)
    model.fit(batches, epochs=2, shuffle=False, verbose=0)
    assert relative_difference(model.get_weights(), reference.get_weights()) < TOLERANCE


# hf.Strategy kinds, each training from every reader of tests/mpi/hdf5_inputs.py
KINDS = ["data", "model"]
READERS = ["mlp", "sample_weight", "multi_io", "list_inputs", "shuffled"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank launch for every kind and reader: case "<kind>-<reader>" -> rank results."""
    path = _write_small(tmp_path_factory.mktemp("hdf5") / "small.h5")
    results = run_scenario("hdf5_inputs", 2, "equivalence", str(path), *KINDS, timeout=540)
    cases = [f"{kind}-{reader}" for kind in KINDS for reader in READERS]
    by_case = {case: [] for case in cases}
    for rank_result in results:
        assert [r["case"] for r in rank_result["results"]] == cases
        for r in rank_result["results"]:
            by_case[r["case"]].append({"rank": rank_result["rank"], **r})
    return by_case


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_match_keras(two_ranks, kind, reader):
    for r in two_ranks[f"{kind}-{reader}"]:
        where = f"rank {r['rank']}"
        assert r["weights"] < TOLERANCE, f"{where}: weights differ by {r['weights']:.2e}"
        if reader == "shuffled":  # shuffling really changed the batches
            assert r["differs_from_unshuffled"] > 1e-3, where
        else:
            assert r["history"] < TOLERANCE, f"{where}: History differs by {r['history']}"
            assert r["evaluate"] < TOLERANCE, f"{where}: evaluate differs by {r['evaluate']}"


def _write_large(path, size: int) -> None:
    """`size` bytes of float32 rows and their labels, written in 64 MiB pieces."""
    rows = size // (4 * FEATURES)
    piece = (64 << 20) // (4 * FEATURES)
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", shape=(rows, FEATURES), dtype="float32")
        for start in range(0, rows, piece):
            x[start : start + piece] = rng.random((min(piece, rows - start), FEATURES), "float32")
        f["y"] = rng.integers(0, 4, rows)


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_training_on_a_1_gib_file_stays_far_below_its_size(tmp_path):
    path = tmp_path / "large.h5"
    try:
        _write_large(path, GIB)
        assert path.stat().st_size >= GIB
        results = run_scenario(
            "hdf5_inputs", 2, "memory", str(path), "50", "data", "model", timeout=540
        )
    finally:
        path.unlink(missing_ok=True)
    for rank_result in results:
        assert [r["case"] for r in rank_result["results"]] == ["data-memory", "model-memory"]
        for r in rank_result["results"]:
            growth = r["peak_growth_mib"]
            where = f"rank {rank_result['rank']}, {r['case']}"
            assert growth < 300, f"{where}: peak RSS grew {growth:.0f} MiB on a 1 GiB file"
            assert all(np.isfinite(r["loss"])), where

"""tensorflow-io datasets are ordinary tf.data inputs to hf.fit (where tensorflow-io works).

tensorflow-io 0.37.1, its last release, loads its HDF5 ops only with TensorFlow 2.16-2.17, so
this runs in `make test-compat` (TensorFlow 2.17) and is skipped elsewhere.
"""

import importlib.metadata
import importlib.util

import h5py
import numpy as np
import pytest

from tests.support.models import data
from tests.support.mpirun import run_scenario

TOLERANCE = 1e-5


def _tensorflow_io_usable() -> bool:
    if importlib.util.find_spec("tensorflow_io") is None:
        return False
    major_minor = tuple(int(p) for p in importlib.metadata.version("tensorflow").split(".")[:2])
    return (2, 16) <= major_minor <= (2, 17)


pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(
        not _tensorflow_io_usable(),
        reason="tensorflow-io is not installed, or TensorFlow is outside the 2.16-2.17 its HDF5 "
        "ops load with; `make test-compat` runs this",
    ),
]


@pytest.mark.timeout(300)
def test_tensorflow_io_hdf5_dataset_trains_like_keras(tmp_path):
    path = tmp_path / "mlp.h5"
    x, y = data("mlp")
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y.astype(np.int64)
    results = run_scenario("tfio_input", 2, str(path), "data", "model", timeout=240)
    for rank_result in results:
        assert rank_result["read_back"], f"rank {rank_result['rank']} read other data"
        assert [r["kind"] for r in rank_result["results"]] == ["data", "model"]
        for r in rank_result["results"]:
            where = f"rank {rank_result['rank']}, {r['kind']}"
            assert r["steps"] == r["ref_steps"] == 10, f"{where}: {r['steps']} optimizer steps"
            assert r["weights"] < TOLERANCE, f"{where}: weights differ by {r['weights']:.2e}"
            assert r["history"] < TOLERANCE, f"{where}: History differs by {r['history']:.2e}"

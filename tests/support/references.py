"""A Keras reference trained once per test session and shared by every rank of every launch.

Each equivalence scenario compares hf.fit with plain Keras's fit of the same model on the same
data. Training that reference on every rank repeats one process's work N times on a machine
with fewer cores than ranks, and the same reference serves several launches (a model's data,
pipeline and hybrid layouts). Here one rank (its owner, chosen from the key) trains it when no
earlier launch of the session has, writes what the comparison needs to a file, and every rank
reads that file. A scenario that knows its cases first calls `prefetch`, so that each rank trains
the references it owns at once and no rank waits alone while another trains them one by one.

The files live in the folder `HF_TEST_REFERENCES` names (tests/conftest.py makes one for the
pytest session), or, for a scenario launched by hand, in the launch's own result folder. A
reference is deterministic for its key (seeded weights and data, one TensorFlow thread per
rank), so a copy read from a file is the reference another rank would have trained.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from collections.abc import Callable

from mpi4py import MPI

from tests.support import zoo
from tests.support.mpirun import REFERENCES_ENV
from tests.support.report import out_dir

POLL_SECONDS = 0.05  # sleep between looks, so waiting ranks leave the cores to rank 0


def folder() -> str:
    """Where references are kept: the session's folder, else this launch's result folder."""
    path = os.environ.get(REFERENCES_ENV) or os.path.join(out_dir(), "references")
    os.makedirs(path, exist_ok=True)
    return path


Request = tuple[dict, Callable[[], dict]]  # a reference's key and how to train it


def shared(key: dict, train: Callable[[], dict]) -> dict:
    """`train()`'s result (picklable) for `key`: trained by the key's owner rank unless on file,
    read by all.

    `key` names everything the reference depends on (scenario, model, optimizer, dtype policy,
    epochs); two callers with equal keys must train the same thing. The owner writes the file
    atomically; the other ranks sleep-poll for it (a failure on the owner ends the job, as any
    scenario error does)."""
    result = _train_if_owner(key, train)
    if result is not None:
        return result
    path = _path(key)
    while not os.path.exists(path):
        time.sleep(POLL_SECONDS)
    with open(path, "rb") as f:
        return pickle.load(f)


def prefetch(requests: list[Request]) -> None:
    """Train now, each on its owner rank, the references of `requests` not on file yet; no
    waiting here (`shared` reads them when each case needs its own)."""
    done = set()
    for key, train in requests:
        path = _path(key)
        if path not in done:
            done.add(path)
            _train_if_owner(key, train)


def _train_if_owner(key: dict, train: Callable[[], dict]) -> dict | None:
    """Train and write `key`'s reference if this rank owns it and no file holds it yet."""
    path = _path(key)
    comm = MPI.COMM_WORLD
    owner = int(os.path.basename(path).split(".")[0], 16) % comm.Get_size()
    if comm.Get_rank() != owner or os.path.exists(path):
        return None
    result = train()
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    return result


def _path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(folder(), f"{digest}.pickle")


def zoo_fit(name: str, optimizer: str, policy: str = "float32", one_step: bool = False) -> dict:
    """Keras's own fit of zoo model `name` on `zoo.training_data`: its weights and History."""
    return shared(*zoo_request(name, optimizer, policy, one_step))


def zoo_request(name: str, optimizer: str, policy: str = "float32", one_step: bool = False):
    """`zoo_fit`'s key and training, for `prefetch`."""

    def train() -> dict:
        x, y, batch_size, epochs = zoo.training_data(name, one_step)
        model = zoo.compiled(name, optimizer, policy)
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        return {"weights": model.get_weights(), "history": history.history}

    key = {"fit": "zoo", "model": name, "optimizer": optimizer, "policy": policy,
           "one_step": one_step}  # fmt: skip
    return key, train

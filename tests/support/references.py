"""A Keras reference trained once per test session and shared by every rank of every launch.

Each equivalence scenario compares hf.fit with plain Keras's fit of the same model on the same
data. Training that reference on every rank repeats one process's work N times on a machine
with fewer cores than ranks, and the same reference serves several launches (a model's data,
pipeline and hybrid layouts). Here the first rank to claim a reference trains it, when no earlier
launch of the session has, and writes what the comparison needs to a file that every rank reads.
A claim is a file made with `O_EXCL`, so exactly one rank of a launch wins it. A scenario that
knows its cases first calls `prefetch`: each rank claims and trains the next unclaimed reference
until none is left, so the ranks share the work by its real cost (a keras_hub model's reference
takes ten times a small MLP's) and no rank waits alone while another trains.

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
    """`train()`'s result (picklable) for `key`: trained by the rank that claims it unless on
    file, read by all.

    `key` names everything the reference depends on (scenario, model, optimizer, dtype policy,
    epochs); two callers with equal keys must train the same thing. The claiming rank writes the
    file atomically; the other ranks sleep-poll for it (a failure there ends the job, as any
    scenario error does)."""
    result = _train_if_claimed(key, train)
    if result is not None:
        return result
    path = _path(key)
    while not os.path.exists(path):
        time.sleep(POLL_SECONDS)
    with open(path, "rb") as f:
        return pickle.load(f)


def prefetch(requests: list[Request]) -> None:
    """Train now the references of `requests` not on file yet, each on the first rank to claim
    it; no waiting here (`shared` reads them when each case needs its own)."""
    for key, train in requests:
        _train_if_claimed(key, train)


def _train_if_claimed(key: dict, train: Callable[[], dict]) -> dict | None:
    """Train and write `key`'s reference if no file holds it yet and this rank is the first of
    its launch to claim it."""
    path = _path(key)
    if os.path.exists(path) or not _claim(path):
        return None
    result = train()
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as f:
        pickle.dump(result, f)
    os.replace(temporary, path)
    return result


def _claim(path: str) -> bool:
    """True for the one rank of this launch that creates `path`'s claim file. The claim names
    the launch (PMIx's namespace: one per mpirun, the same on every emulated node, where each
    node's ranks have their own daemon for a parent), so a claim left by a launch that failed
    holds no later one."""
    launch = os.environ.get("PMIX_NAMESPACE") or str(os.getppid())
    claim = f"{path}.{launch}.claim"
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


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

    key = {
        "fit": "zoo",
        "model": name,
        "optimizer": optimizer,
        "policy": policy,
        "one_step": one_step,
    }
    return key, train

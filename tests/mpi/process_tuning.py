"""hf.fit leaves the process alone by default; Strategy(tune_process=True) tunes it."""

import os

import keras
import numpy as np

import hyparflow as hf
from hyparflow.comm import hugepages
from hyparflow.launch import malloc
from tests.support.report import report, run_or_abort


def thread_cores() -> list:
    """The distinct CPU sets of this process's threads."""
    masks = set()
    for task in os.listdir("/proc/self/task"):
        try:
            masks.add(frozenset(os.sched_getaffinity(int(task))))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return sorted(map(sorted, masks))


def fit(tune: bool) -> None:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((32, 8), "float32"), np.ones((32, 2), "float32")
    strategy = hf.Strategy("hybrid", partitions=2, replicas=2, tune_process=tune)
    hf.fit(model, x, y, batch_size=8, epochs=1, strategy=strategy, verbose=0)


def state() -> dict:
    return {
        "thread_cores": thread_cores(),
        "heap_kept": malloc._applied,  # None: mallopt never called
        "huge_pages": hugepages.promoter().enabled,
        "huge_pages_reason": hugepages.promoter().reason,
    }


def main():
    launched = sorted(os.sched_getaffinity(0))
    fit(tune=False)
    default = state()
    fit(tune=True)
    report({"launched": launched, "default": default, "tuned": state()})


run_or_abort(main)

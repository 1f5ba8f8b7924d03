"""Checkpoint folders, manifests and atomic writes (no MPI, no TensorFlow)."""

import contextlib
import os
import time

import numpy as np
import pytest

from hyparflow.checkpoint import manifest as manifests
from hyparflow.checkpoint import store
from hyparflow.checkpoint.atomic import sha256, write_atomic
from hyparflow.checkpoint.state import cut_shard, join_shards, shard_key
from hyparflow.comm.watchdog import Watchdog, resolve_timeout


def _manifest(step):
    return manifests.Manifest(
        step=step,
        epoch=0,
        batch=step,
        seed=1,
        partitions=2,
        replicas=1,
        weights=[["d/kernel", [2, 3], "float32"]],
        files={},
    )


def _checkpoint(directory, step, complete=True):
    folder = os.path.join(directory, manifests.folder_name(step))
    os.makedirs(folder)
    if complete:
        manifests.write(folder, _manifest(step))
    return folder


def test_only_folders_with_a_manifest_count_and_the_newest_wins(tmp_path):
    d = str(tmp_path)
    assert manifests.latest(d) is None
    _checkpoint(d, 2)
    _checkpoint(d, 10)
    _checkpoint(d, 12, complete=False)  # a save that died before its manifest
    assert [s for s, _ in manifests.complete_checkpoints(d)] == [2, 10]
    assert manifests.latest(d).endswith("ckpt-000000010")
    assert manifests.read(manifests.latest(d)) == _manifest(10)


def test_prune_keeps_the_newest_and_drops_torn_saves(tmp_path):
    d = str(tmp_path)
    for step in (1, 2, 3):
        _checkpoint(d, step)
    torn = _checkpoint(d, 4, complete=False)
    current = _checkpoint(d, 5)
    manifests.prune(d, keep=2, current=current)
    assert sorted(os.listdir(d)) == ["ckpt-000000003", "ckpt-000000005"]
    assert not os.path.exists(torn)


def test_atomic_write_leaves_nothing_behind_when_the_writer_fails(tmp_path):
    path = str(tmp_path / "file.bin")

    def fail(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomic(path, fail)
    assert not os.path.exists(path)
    write_atomic(path, lambda f: f.write(b"whole"))
    with open(path, "rb") as f:
        assert f.read() == b"whole"
    assert len(sha256(path)) == 64


def test_weight_mismatch_is_described():
    saved = [["a/kernel", [2, 3], "float32"], ["a/bias", [3], "float32"]]
    assert manifests.describe_mismatch(saved, saved) is None
    assert "holds 2 weights" in manifests.describe_mismatch(saved, saved[:1])
    other = [["b/kernel", [2, 4], "float32"], ["b/bias", [3], "float32"]]
    assert "(2, 3) float32 in the checkpoint" in manifests.describe_mismatch(saved, other)
    renamed = [["x/kernel", [2, 3], "float32"], ["x/bias", [3], "float32"]]
    assert manifests.describe_mismatch(saved, renamed) is None  # names may differ per process


class _Comm:
    def Get_rank(self):
        return 3


def test_watchdog_reports_the_operation_peer_and_step_after_the_timeout(monkeypatch):
    aborted = []
    dog = Watchdog(_Comm(), timeout=0.2, abort=lambda: aborted.append(True), poll=0.02)
    dog.step = 7
    with dog.guard("receive gradients", peer=2, microbatch=1):
        assert dog.report() is None  # not yet
        deadline = time.monotonic() + 5
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        message = dog.report()
    dog.close()
    assert aborted == [True]
    assert "rank 3" in message and "receive gradients" in message
    assert "step 7" in message and "micro-batch 1" in message and "peer rank 2" in message
    assert dog.report() is None  # no operation in progress any more


def test_watchdog_timeout_comes_from_argument_then_environment(monkeypatch):
    monkeypatch.setenv("HYPARFLOW_WATCHDOG_TIMEOUT", "42")
    assert resolve_timeout(None) == 42.0
    assert resolve_timeout(5) == 5.0
    monkeypatch.delenv("HYPARFLOW_WATCHDOG_TIMEOUT")
    assert resolve_timeout(None) == 300.0
    with pytest.raises(ValueError, match=">= 0"):
        resolve_timeout(-1)


class _Variable:
    def __init__(self, path, value):
        self.path, self.value = path, np.asarray(value, np.float32)
        self.shape, self.dtype = self.value.shape, "float32"

    def numpy(self):
        return self.value

    def assign(self, value):
        self.value = np.asarray(value, np.float32)


class _Model:
    """Just what a checkpoint reads of a model: weights, optimizer, metric states, layers."""

    def __init__(self, values):
        self.weights = [_Variable(f"d/w{i}", v) for i, v in enumerate(values)]
        self.optimizer = type("Optimizer", (), {"built": False, "variables": []})()
        self.metrics_variables = [_Variable("m/total", 0.0)]

    def _flatten_layers(self, include_self=True, recursive=True):
        return []

    def to_json(self):
        raise NotImplementedError  # like a subclassed model: no architecture file

    def get_compile_config(self):
        raise NotImplementedError


class _World:
    def Get_rank(self):
        return 0

    def Barrier(self):
        pass

    def gather(self, value, root=0):
        return [value]


class _StageState:
    """A one-rank `StageState` without the engine: all checkpoint/ needs."""

    def __init__(self, model, step=0):
        self.model, self.variables, self.world = model, [], _World()
        self.stage = self.replica = 0
        self.num_stages = self.num_replicas = 1
        self.is_last = True
        self.step, self.seed, self.pending_metric_states = step, 5, []
        self.shard, self.num_shards, self.split, self.shard_variables = 0, 1, {}, {}
        self.writes_pieces = True

    def guard(self, operation):
        return contextlib.nullcontext()

    def owned_weight_indices(self):
        return list(range(len(self.model.weights)))

    def runs_layer(self, layer):
        return True

    def summed_metric_states(self):
        return [v.numpy() for v in self.model.metrics_variables]


def test_save_and_restore_go_through_the_narrow_stage_state(tmp_path):
    saved = _StageState(_Model([[1.0, 2.0], [3.0]]), step=4)
    saved.model.metrics_variables[0].assign(7.0)
    folder = store.save(saved, str(tmp_path), epoch=1, batch=2)
    manifest, arrays = store.read_checked(folder, saved.model)
    assert (manifest.step, manifest.epoch, manifest.batch, manifest.seed) == (4, 1, 2, 5)
    fresh = _StageState(_Model([[0.0, 0.0], [0.0]]))
    store.restore(fresh, manifest, arrays)
    assert fresh.step == 4
    assert [w.numpy().tolist() for w in fresh.model.weights] == [[1.0, 2.0], [3.0]]
    assert [float(m) for m in fresh.pending_metric_states] == [7.0]


def test_tensor_pieces_join_along_their_axis_and_a_missing_piece_is_named():
    whole = np.arange(24.0).reshape(4, 6)
    state = {
        "w/0": np.ones(3),
        **{shard_key("w/1", t, 3, 1): cut_shard(whole, t, 3, 1) for t in range(3)},
    }
    joined = join_shards(state)
    assert sorted(joined) == ["w/0", "w/1"] and np.array_equal(joined["w/1"], whole)
    del state[shard_key("w/1", 2, 3, 1)]
    with pytest.raises(ValueError, match=r"pieces \[0, 1\] of 3 of 'w/1'"):
        join_shards(state)

"""A GPU transport that cannot crash: CUDA-awareness detection, staging, GPU binding (issue #30).

No GPU exists where these tests run, and TensorFlow's CUDA build cannot be installed on the GPU
machines this project can borrow (docs/gpu.md). So the facts are injected, as the issue asks:
the detection rule gets its facts as arguments; a "GPU tensor" is a CPU tensor that the
channel is told lives on GPU:0 (its device lookup is replaced); binding gets what each rank
sees as data, and the TensorFlow calls that would bind are replaced by recorders. The MPI
traffic itself is real: one process talking to itself over MPI.COMM_SELF, dressed as rank 0
of 2, which records every buffer handed to MPI.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

from hyparflow import devices
from hyparflow.comm import agree, allreduce, cuda_aware, dlpack, p2p
from hyparflow.comm.allreduce import GradientReducer
from hyparflow.comm.cuda_aware import CudaAwareness, MpiFacts, combine, decide
from hyparflow.comm.p2p import BACKWARD, FORWARD, PipeChannel
from hyparflow.launch import gpu
from hyparflow.launch.gpu import Binding, NoGpuError, RankGpus, choose_gpu
from hyparflow.strategy import Strategy

GPU = "/job:localhost/replica:0/task:0/device:GPU:0"
OPEN_MPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4\x00"
MPICH = "MPICH Version:      4.1.2\nMPICH Release date: Wed Jun  7 15:22:45 CDT 2023"
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)"
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS"
NOT_AWARE = CudaAwareness(False, "injected: not CUDA-aware")
AWARE = CudaAwareness(True, "injected: CUDA-aware")


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    """Each test starts as a fresh process would: nothing settled, nothing warned yet."""
    monkeypatch.setattr(cuda_aware, "_local", None)
    monkeypatch.setattr(cuda_aware, "_settled", None)
    monkeypatch.setattr(cuda_aware, "_warned", False)
    monkeypatch.setattr(gpu, "_warned_late", False)


# ---- detection: the decision table -----------------------------------------------------------

CASES = [
    # (library version, query_cuda, query_gpu_cuda, built_with_cuda, environment, aware, reason)
    (OPEN_MPI, 0, None, None, {}, False, "MPIX_Query_cuda_support() returned 0"),
    (OPEN_MPI, 1, None, None, {}, True, "MPIX_Query_cuda_support() returned 1"),
    (OPEN_MPI, 1, None, None, {"OMPI_MCA_opal_cuda_support": "0"}, False, "turns off"),
    (OPEN_MPI, 0, None, None, {"OMPI_MCA_opal_cuda_support": "1"}, False, "returned 0"),
    (OPEN_MPI, None, None, None, {}, False, "no CUDA query"),
    (OPEN_MPI, None, None, True, {}, True, "mpi_built_with_cuda_support=true"),
    (OPEN_MPI, None, None, False, {}, False, "mpi_built_with_cuda_support=false"),
    (OPEN_MPI, None, None, None, {"OMPI_MCA_opal_cuda_support": "1"}, False, "no CUDA query"),
    (OPEN_MPI, None, None, None, {"MV2_USE_CUDA": "1"}, False, "no CUDA query"),  # not its switch
    (OPEN_MPI, 0, None, None, {"HYPARFLOW_CUDA_AWARE": "1"}, True, "set by the user"),
    (OPEN_MPI, 1, None, None, {"HYPARFLOW_CUDA_AWARE": "0"}, False, "set by the user"),
    (OPEN_MPI, 1, None, None, {"HYPARFLOW_CUDA_AWARE": " "}, True, "returned 1"),  # blank: unset
    (MPICH, None, 1, None, {}, True, "MPIX_GPU_query_support(CUDA) returned 1"),
    (MPICH, 1, 0, None, {}, False, "MPIX_GPU_query_support(CUDA) returned 0"),  # all must agree
    (MPICH, None, None, None, {"MPIR_CVAR_ENABLE_GPU": "1"}, True, "turns on MPICH"),
    (MPICH, None, 1, None, {"MPIR_CVAR_ENABLE_GPU": "0"}, False, "MPIR_CVAR_ENABLE_GPU=0"),
    (MPICH, None, None, None, {}, False, "no CUDA query"),
    (MVAPICH, None, None, None, {"MV2_USE_CUDA": "1"}, True, "turns on MVAPICH"),
    (MVAPICH, None, None, None, {"MV2_USE_CUDA": "yes"}, True, "MV2_USE_CUDA=yes"),
    (MVAPICH, 1, None, None, {"MV2_USE_CUDA": "0"}, False, "turns off"),
    (MVAPICH, None, None, None, {}, False, "no CUDA query"),
    (CRAY, None, None, None, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, True, "turns on Cray MPICH"),
    (CRAY, None, None, None, {"MPIR_CVAR_ENABLE_GPU": "1"}, False, "no CUDA query"),
    (INTEL, None, None, None, {"I_MPI_OFFLOAD": "1"}, False, "no CUDA query"),
    ("", None, None, None, {"MV2_USE_CUDA": "1"}, False, "an unidentified MPI"),
    ("", None, None, None, {"HYPARFLOW_CUDA_AWARE": "true"}, True, "set by the user"),
]


@pytest.mark.parametrize("version, query, gpu_query, built, env, aware, reason", CASES)
def test_detection_decides_from_injected_facts(
    version, query, gpu_query, built, env, aware, reason
):
    answer = decide(MpiFacts(version, query, gpu_query, built, env))
    assert answer.aware is aware and reason in answer.reason


def test_a_bad_switch_value_is_an_error_naming_it():
    with pytest.raises(ValueError, match="HYPARFLOW_CUDA_AWARE='maybe' is neither on"):
        decide(MpiFacts(OPEN_MPI, environ={"HYPARFLOW_CUDA_AWARE": "maybe"}))
    with pytest.raises(ValueError, match="MV2_USE_CUDA='2'"):
        decide(MpiFacts(MVAPICH, environ={"MV2_USE_CUDA": "2"}))


def test_ranks_agree_aware_only_if_every_rank_is():
    assert combine([AWARE, AWARE]).aware
    mixed = combine([AWARE, NOT_AWARE, NOT_AWARE])
    assert not mixed.aware and mixed.reason == f"rank 1: {NOT_AWARE.reason}"


def test_this_machines_mpi_is_asked_through_ctypes():
    """The edge on the MPI that mpi4py loaded here (Debian's Open MPI 4.1.4 on the project's
    machines: it exports MPIX_Query_cuda_support, which answers 0)."""
    facts = cuda_aware.gather_facts(environ={})
    assert facts.library_version == MPI.Get_library_version()
    if cuda_aware.library_family(facts.library_version) == "openmpi":
        assert facts.query_cuda in (0, 1)  # Open MPI >= 2 always has the cuda extension here
        assert facts.query_gpu_cuda is None  # MPICH's query: not in Open MPI
    if "Debian OpenMPI" in facts.library_version:
        assert facts.query_cuda == 0
        assert decide(facts) == CudaAwareness(
            False, "Open MPI v4.1.4: MPIX_Query_cuda_support() returned 0"
        )


def test_detection_is_cached_per_process_and_settled_answers_win(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_aware, "gather_facts", lambda: calls.append(1) or MpiFacts(OPEN_MPI))
    assert cuda_aware.detect() is cuda_aware.detect() and len(calls) == 1
    cuda_aware.settle(AWARE)
    assert cuda_aware.detect() is AWARE and cuda_aware.resolve(None) is AWARE
    assert cuda_aware.resolve(False).aware is False and cuda_aware.resolve(NOT_AWARE) is NOT_AWARE


# ---- transport: a GPU tensor never reaches an MPI that is not CUDA-aware ---------------------


class Loopback:
    """MPI.COMM_SELF dressed as rank 0 of a 2-rank communicator: what is sent to "rank 1"
    arrives here. Every buffer handed to MPI is recorded."""

    def __init__(self):
        self.inner, self.handed = MPI.COMM_SELF, []

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def Get_attr(self, key):
        return MPI.COMM_WORLD.Get_attr(key)

    def Isend(self, message, dest, tag):
        self.handed.append(message[0])
        return self.inner.Isend(message, dest=0, tag=tag)

    def Irecv(self, message, source, tag):
        self.handed.append(message[0])
        return self.inner.Irecv(message, source=0, tag=tag)

    def Allreduce(self, send, recv):
        self.handed.append(recv[0] if isinstance(recv, list) else recv)
        return self.inner.Allreduce(send, recv)


def on_gpu_in(monkeypatch, *modules):
    """Make every TF tensor report GPU:0 to `modules` (numpy arrays stay host objects)."""
    for module in modules:
        monkeypatch.setattr(module, "tensor_device", lambda v: GPU if tf.is_tensor(v) else None)


SPECS = [((4, 3), "float32"), ((4, None), "bfloat16"), ((4, 2), "int32")]


def tensors(batch=4, length=5):
    return [
        tf.reshape(tf.range(batch * 3, dtype=tf.float32), (batch, 3)),
        tf.cast(tf.reshape(tf.range(batch * length), (batch, length)), tf.bfloat16),
        tf.fill((batch, 2), 7),
    ]


def round_trip(channel, sent, microbatch=0):
    handle = channel.isend(sent, microbatch, FORWARD)
    received = channel.recv(microbatch, FORWARD)
    handle.wait()
    for got, want in zip(received, sent, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    return received


@contextlib.contextmanager
def no_staging_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if "stages GPU tensors" in str(w.message)]


def is_host(buffer) -> bool:
    return isinstance(buffer, np.ndarray)


def test_gpu_tensors_are_staged_through_host_memory_when_mpi_is_not_cuda_aware(monkeypatch):
    """The acceptance test: with the answer "not CUDA-aware" injected, tensors on GPU:0 are
    sent and received over real MPI, and every buffer MPI is handed is a host numpy array (no
    DLPack adapter, no tensor); received tensors are copied to the channel's GPU."""
    on_gpu_in(monkeypatch, p2p)
    placed = []
    monkeypatch.setattr(
        p2p, "to_device", lambda t, device: placed.append(device) or dlpack.to_device(t, device)
    )
    comm = Loopback()
    with pytest.warns(RuntimeWarning, match="stages GPU tensors through host memory"):
        channel = PipeChannel(comm, 1, SPECS, 2, device=GPU, cuda_aware=NOT_AWARE)
        round_trip(channel, tensors(4, 5), 0)
    assert channel.stages_receives and not channel.receives_on_device
    round_trip(channel, tensors(2, 9), 1)  # a smaller batch, a longer dynamic tensor
    assert comm.handed and all(is_host(b) for b in comm.handed)
    assert not any(isinstance(b, (dlpack.DLPackAdapter, tf.Tensor)) for b in comm.handed)
    assert placed == [GPU] * 6  # every received tensor goes to the GPU


def test_the_same_tensors_take_the_device_path_when_mpi_is_cuda_aware(monkeypatch):
    """The contrast: only the detection answer differs, and MPI then gets DLPack adapters for
    the data (shape headers stay host arrays)."""
    on_gpu_in(monkeypatch, p2p)
    comm = Loopback()
    channel = PipeChannel(comm, 1, SPECS, 2, device=GPU, cuda_aware=AWARE)
    assert channel.receives_on_device and not channel.stages_receives
    with no_staging_warning():
        round_trip(channel, tensors(), 0)
    adapters = [b for b in comm.handed if isinstance(b, dlpack.DLPackAdapter)]
    assert len(adapters) == 6  # three sends, three receives
    headers = [b for b in comm.handed if not isinstance(b, dlpack.DLPackAdapter)]
    assert len(headers) == 2 and all(is_host(b) and b.dtype == np.int64 for b in headers)


def test_forcing_the_device_path_on_a_gpu_without_cuda_aware_mpi_is_refused(monkeypatch):
    on_gpu_in(monkeypatch, p2p)
    comm = Loopback()
    with pytest.raises(RuntimeError, match="transport='device' would hand GPU memory"):
        PipeChannel(comm, 1, SPECS, 2, transport="device", device=GPU, cuda_aware=NOT_AWARE)
    cpu_channel = PipeChannel(
        comm, 1, SPECS, 2, transport="device", device="/CPU:0", cuda_aware=NOT_AWARE
    )
    with pytest.raises(RuntimeError, match="HYPARFLOW_CUDA_AWARE=1 if this MPI library"):
        cpu_channel.isend(tensors(), 0, FORWARD)
    assert comm.handed == []  # refused before any MPI call


def test_forcing_the_device_path_on_cpu_still_exercises_the_adapter():
    comm = Loopback()
    channel = PipeChannel(comm, 1, SPECS, 2, transport="device", cuda_aware=NOT_AWARE)
    round_trip(channel, tensors(), 0)
    assert sum(isinstance(b, dlpack.DLPackAdapter) for b in comm.handed) == 6


def test_the_default_answer_is_detected_only_for_gpu_memory(monkeypatch):
    monkeypatch.setattr(cuda_aware, "gather_facts", lambda: pytest.fail("detected on CPU"))
    round_trip(PipeChannel(Loopback(), 1, SPECS, 2), tensors(), 0)
    monkeypatch.setattr(cuda_aware, "gather_facts", lambda: MpiFacts(OPEN_MPI, query_cuda=0))
    on_gpu_in(monkeypatch, p2p)
    comm = Loopback()
    with pytest.warns(RuntimeWarning, match="MPIX_Query_cuda_support\\(\\) returned 0"):
        round_trip(PipeChannel(comm, 1, SPECS, 2, device=GPU), tensors(), 0)
    assert all(is_host(b) for b in comm.handed)


def test_the_staging_warning_comes_once_and_from_rank_0_only():
    with pytest.warns(RuntimeWarning) as caught:
        assert cuda_aware.warn_staging(NOT_AWARE, rank=0)
        assert not cuda_aware.warn_staging(NOT_AWARE, rank=0)
    assert len(caught) == 1 and "HYPARFLOW_CUDA_AWARE=1" in str(caught[0].message)
    assert "injected: not CUDA-aware" in str(caught[0].message)
    cuda_aware._warned = False
    with no_staging_warning():
        assert not cuda_aware.warn_staging(NOT_AWARE, rank=1)
        assert not cuda_aware.warn_staging(AWARE, rank=0)


def test_a_host_transport_stages_without_warning(monkeypatch):
    on_gpu_in(monkeypatch, p2p)
    comm = Loopback()
    with no_staging_warning():
        channel = PipeChannel(comm, 1, SPECS, 2, transport="host", device=GPU, cuda_aware=AWARE)
        round_trip(channel, tensors(), 0)
    assert all(is_host(b) for b in comm.handed)


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_a_flat_gpu_gradient_is_reduced_in_a_host_copy_and_comes_back(monkeypatch, op):
    """`reduce_flat` reduces a CPU tensor in its own memory; a GPU tensor's `np.asarray` is a
    copy, so that would have reduced a copy and returned the gradient unreduced. It is now
    staged: MPI gets a private host array, and the result is the reduced values."""
    on_gpu_in(monkeypatch, allreduce)
    comm = Loopback()
    reducer = GradientReducer(comm, op=op, bucket_bytes=16)  # 4 floats per MPI call
    flat = tf.range(10, dtype=tf.float32) + tf.ones(10)
    result = reducer.reduce_flat(flat)
    expected = np.arange(1, 11, dtype=np.float32) / (2 if op == "mean" else 1)
    np.testing.assert_allclose(np.asarray(result), expected)  # COMM_SELF: one rank's sum
    assert reducer.mpi_calls == 3 and len(comm.handed) == 3
    assert all(is_host(b) and not np.shares_memory(b, np.asarray(flat)) for b in comm.handed)
    with pytest.raises(ValueError, match="1-D float32"):
        reducer.reduce_flat(tf.ones((2, 2)))


def test_bucketed_gradients_reach_mpi_as_host_buckets(monkeypatch):
    on_gpu_in(monkeypatch, allreduce)
    comm = Loopback()
    reducer = GradientReducer(comm, op="sum")
    grads = [tf.ones((3, 2)), tf.fill((4,), 2.0)]
    reduced = reducer.reduce(grads)
    np.testing.assert_array_equal(np.asarray(reduced[1]), [2.0] * 4)
    assert comm.handed and all(is_host(b) for b in comm.handed)


# ---- binding: one GPU per rank --------------------------------------------------------------

SLURM = "CUDA_VISIBLE_DEVICES=0,1,2,3"


@pytest.mark.parametrize(
    "local_rank, node, gpu_index",
    [
        (0, [RankGpus(1)], 0),  # one rank, one GPU
        (1, [RankGpus(4)] * 2, 1),  # fewer ranks than GPUs
        (3, [RankGpus(4)] * 4, 3),  # as many
        (2, [RankGpus(4, SLURM)] * 3, 2),  # the same list for every rank (Slurm's --gres)
        (0, [RankGpus(0)] * 4, None),  # a CPU node
        (0, [RankGpus(1, "CUDA_VISIBLE_DEVICES=0"), RankGpus(1, "CUDA_VISIBLE_DEVICES=1")], None),
        (
            1,
            [RankGpus(2, "CUDA_VISIBLE_DEVICES=0,1"), RankGpus(2, "CUDA_VISIBLE_DEVICES=2,3")],
            None,
        ),
        (0, [RankGpus(4, narrowed=True)] * 2, None),  # the process chose already (tf.config)
    ],
)
def test_binding_decision_table(local_rank, node, gpu_index):
    binding = choose_gpu(local_rank, node)
    assert binding.gpu == gpu_index and binding.reason


def test_a_rank_without_a_gpu_on_a_gpu_node_is_an_error():
    with pytest.raises(NoGpuError, match=r"3 ranks share a node whose ranks see 2 GPU\(s\)"):
        choose_gpu(0, [RankGpus(2)] * 3)  # every rank refuses: rank 2 would have none
    with pytest.raises(NoGpuError, match=r"rank\(s\) \[1\] would have none.*ppr:1:node"):
        choose_gpu(1, [RankGpus(1, "CUDA_VISIBLE_DEVICES=0")] * 2)
    with pytest.raises(NoGpuError, match=r"rank 1 sees no GPU \(CUDA_VISIBLE_DEVICES=\) while"):
        choose_gpu(1, [RankGpus(2), RankGpus(0, "CUDA_VISIBLE_DEVICES=")])
    with pytest.raises(ValueError, match="local rank 2 is not one of 2"):
        choose_gpu(2, [RankGpus(2)] * 2)


def test_binding_can_be_turned_off():
    assert choose_gpu(0, [RankGpus(2)] * 3, enabled=False).gpu is None  # sharing on purpose
    assert gpu.enabled({}) and gpu.enabled({"HYPARFLOW_BIND_GPUS": "1"})
    assert not gpu.enabled({"HYPARFLOW_BIND_GPUS": "0"})
    assert not Strategy().bind_gpus and Strategy(bind_gpus=True).bind_gpus  # an opt-in
    with pytest.raises(ValueError, match="bind_gpus='no' must be True or False"):
        Strategy(bind_gpus="no")


def test_visibility_names_every_variable_set():
    env = {"CUDA_VISIBLE_DEVICES": "1", "ROCR_VISIBLE_DEVICES": "0", "PATH": "/bin"}
    assert gpu.visibility(env) == "CUDA_VISIBLE_DEVICES=1 ROCR_VISIBLE_DEVICES=0"
    assert gpu.visibility({}) == ""


def test_the_node_view_comes_from_mpis_shared_memory_split():
    """The real split on this process's world (one rank here: the node is this process)."""
    mine = RankGpus(3, "CUDA_VISIBLE_DEVICES=0,1,2")
    local_rank, node = gpu.node_view(MPI.COMM_WORLD, mine)
    assert MPI.COMM_WORLD.Get_size() == 1 and (local_rank, node) == (0, [mine])


class FakeTf:
    """Records what binding asks of tf.config; `initialised` makes it refuse as TF does."""

    def __init__(self, monkeypatch, count=2, initialised=False):
        self.gpus = [
            tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(count)
        ]
        self.visible, self.growth, self.initialised = list(self.gpus), [], initialised
        monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: self.gpus)
        monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind=None: self.visible)
        monkeypatch.setattr(tf.config, "set_visible_devices", self.set_visible)
        monkeypatch.setattr(tf.config.experimental, "set_memory_growth", self.set_growth)

    def set_visible(self, devices, kind=None):
        if self.initialised:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.visible = list(devices)

    def set_growth(self, device, enable):
        self.growth.append((device.name, enable))


def test_bind_keeps_one_gpu_with_memory_growth(monkeypatch):
    fake = FakeTf(monkeypatch, count=2)
    assert gpu.local_view() == RankGpus(2, gpu.visibility(), narrowed=False)
    assert gpu.bind(Binding(1, "test"))
    assert fake.visible == [fake.gpus[1]] and fake.growth == [(fake.gpus[1].name, True)]
    assert gpu.local_view().narrowed  # a later hf.fit leaves it as it is


def test_bind_after_tensorflow_initialised_its_gpus_leaves_them_and_says_so(monkeypatch, caplog):
    fake = FakeTf(monkeypatch, count=2, initialised=True)
    with caplog.at_level(logging.WARNING, logger=gpu.__name__):
        assert not gpu.bind(Binding(1, "test"))
        assert not gpu.bind(Binding(1, "test"))
    assert fake.visible == fake.gpus and fake.growth == []
    assert len(caplog.records) == 1 and "hf.bind_gpus()" in caplog.text


def test_on_a_machine_without_gpus_binding_touches_nothing(monkeypatch):
    assert not tf.config.list_physical_devices("GPU")  # this machine
    assert gpu.local_view() == RankGpus(0, gpu.visibility(), narrowed=False)
    assert not gpu.bind(Binding(None, "no GPU"))
    for name in ("set_visible_devices",):
        monkeypatch.setattr(tf.config, name, lambda *a, **k: pytest.fail("touched TF"))
    monkeypatch.setattr(
        tf.config.experimental, "set_memory_growth", lambda *a, **k: pytest.fail("touched TF")
    )
    monkeypatch.setattr(cuda_aware, "gather_facts", lambda: pytest.fail("detected"))
    monkeypatch.setattr(gpu, "node_view", lambda *a: pytest.fail("split the node"))
    assert devices.prepare(Peers(rank=0, peer={tuple: (0, True)}), bind=True) is None
    assert cuda_aware._settled is None
    assert devices.bind_gpus().gpu is None  # the public call, on this process's real world


class Peers:
    """Rank `rank` of 2: each allgather returns this rank's value and the other rank's, which
    `peer` gives by the value's type (agree()'s error messages: None unless `peer_error`)."""

    def __init__(self, rank, peer, peer_error=None):
        self.rank, self.peer, self.peer_error = rank, peer, peer_error

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return 2

    def allgather(self, value):
        if value is None or isinstance(value, str):
            other = self.peer_error
        else:
            other = self.peer[type(value)]
        return [value, other] if self.rank == 0 else [other, value]


def test_prepare_settles_one_answer_warns_on_rank_0_and_binds(monkeypatch):
    bound = []
    monkeypatch.setattr(gpu, "local_view", lambda: RankGpus(2))
    monkeypatch.setattr(gpu, "node_view", lambda comm, mine: (comm.rank, [mine, RankGpus(2)]))
    monkeypatch.setattr(gpu, "bind", bound.append)
    monkeypatch.setattr(cuda_aware, "local_answer", lambda: NOT_AWARE)
    peer = {tuple: (2, True), CudaAwareness: AWARE}
    with pytest.warns(RuntimeWarning, match="rank 0: injected: not CUDA-aware"):
        answer = devices.prepare(Peers(0, peer), bind=True)
    assert not answer.aware and cuda_aware.detect() == answer
    assert bound == [Binding(0, "node-local rank 0 of 2 keeps GPU 0 of the 2 its ranks see")]
    # The other way round, on rank 1: still not aware (every rank must be), and no warning.
    monkeypatch.setattr(cuda_aware, "local_answer", lambda: AWARE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        answer = devices.prepare(Peers(1, {tuple: (2, True), CudaAwareness: NOT_AWARE}), True)
    assert answer == CudaAwareness(False, "rank 0: injected: not CUDA-aware")
    assert bound[-1].gpu == 1
    # Both aware: the device path everywhere. Binding off: no node split, no bind.
    monkeypatch.setattr(gpu, "node_view", lambda comm, mine: pytest.fail("split the node"))
    answer = devices.prepare(Peers(0, {tuple: (2, True), CudaAwareness: AWARE}), bind=False)
    assert answer.aware and cuda_aware.detect().aware and len(bound) == 2
    devices.prepare(Peers(0, {tuple: (2, False), CudaAwareness: AWARE}), bind=True)  # env off
    assert len(bound) == 2


def test_binding_errors_are_raised_on_every_rank(monkeypatch):
    monkeypatch.setattr(gpu, "local_view", lambda: RankGpus(0, "CUDA_VISIBLE_DEVICES="))
    monkeypatch.setattr(gpu, "node_view", lambda comm, mine: (0, [mine, RankGpus(2)]))
    monkeypatch.setattr(gpu, "bind", lambda b: pytest.fail("bound"))
    monkeypatch.setattr(cuda_aware, "local_answer", lambda: AWARE)
    peer = {tuple: (2, True), CudaAwareness: AWARE}
    with pytest.raises(NoGpuError, match="node-local rank 0 sees no GPU") as failed:
        devices.prepare(Peers(0, peer), bind=True)
    assert agree.is_agreed(failed.value)
    # The rank whose own choice was fine hears of the failure instead of waiting for it.
    monkeypatch.setattr(gpu, "local_view", lambda: RankGpus(2))
    monkeypatch.setattr(gpu, "node_view", lambda comm, mine: (1, [RankGpus(0), mine]))
    failing = Peers(1, {tuple: (0, True), CudaAwareness: AWARE})
    calls = []

    def allgather(value, original=failing.allgather):
        calls.append(value)
        # the third agreement is the binding's: rank 0 failed there
        failing.peer_error = "NoGpuError: no GPU" if len(calls) == 5 else None
        return original(value)

    failing.allgather = allgather
    with pytest.raises(agree.RemoteRankError, match="rank 0 failed: NoGpuError: no GPU"):
        devices.prepare(failing, bind=True)


def test_the_tensor_handed_back_by_a_staged_receive_is_on_the_channels_device(monkeypatch):
    """Backward direction too: gradients received into host buffers come back as tensors."""
    on_gpu_in(monkeypatch, p2p)
    comm = Loopback()
    grad = tf.ones((4, 3))
    with pytest.warns(RuntimeWarning):
        channel = PipeChannel(
            comm, 1, SPECS, 1, backward_specs=SPECS[:1], device=GPU, cuda_aware=NOT_AWARE
        )
        channel.isend([grad], 0, BACKWARD)
    (got,) = channel.recv(0, BACKWARD)
    channel.wait_sends()
    assert tf.is_tensor(got) and np.asarray(got).tolist() == np.asarray(grad).tolist()
    assert all(is_host(b) for b in comm.handed)

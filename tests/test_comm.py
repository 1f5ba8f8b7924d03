"""Communication building blocks: pure pieces in-process, the rest under a real 4-rank mpirun."""

import ast
import itertools
import pathlib

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

from hyparflow.comm import dlpack, failure, idle
from hyparflow.comm.allreduce import GradientReducer, plan_buckets, reduction_dtype
from hyparflow.comm.p2p import (
    DIRECTIONS,
    FORWARD,
    BoundarySpec,
    PipeChannel,
    batch_from_bytes,
    header_tag,
    message_tag,
)
from tests.support.mpirun import run_scenario
from tests.test_hugepages import hugepages_expected

COMM_DIR = pathlib.Path(__file__).parent.parent / "hyparflow" / "comm"


@pytest.fixture(scope="module")
def ranks():
    """One 4-rank launch (2 partitions x 2 replicas) shared by every multi-rank assertion."""
    return run_scenario("comm_checks", 4, timeout=240)


@pytest.fixture(scope="module")
def dynamic_ranks():
    """One 2-rank launch sending tensors whose sequence length changes from step to step."""
    return run_scenario("dynamic_p2p", 2, timeout=180)


# ---- pure pieces -------------------------------------------------------------------------


@given(st.integers(1, 64), st.integers(1, 8))
def test_tags_are_unique_per_microbatch_tensor_and_direction(num_microbatches, num_tensors):
    tags = [
        message_tag(mb, index, direction, num_tensors)
        for mb in range(num_microbatches)
        for index in range(num_tensors)
        for direction in DIRECTIONS
    ]
    assert len(set(tags)) == len(tags)
    assert min(tags) == 0 and max(tags) == len(tags) - 1  # dense: the bound is tight


class FakeComm:
    def __init__(self, tag_ub):
        self.tag_ub = tag_ub

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def Get_attr(self, key):
        return self.tag_ub


def test_channel_refuses_tags_beyond_tag_ub_and_bad_arguments():
    spec = [((2, 3), "float32")]
    PipeChannel(FakeComm(32767), 1, spec, 16384)  # largest tag 32767: fits
    with pytest.raises(ValueError, match="above this MPI's TAG_UB 32767"):
        PipeChannel(FakeComm(32767), 1, spec, 16385)
    with pytest.raises(ValueError, match="peer 0 is not another rank"):
        PipeChannel(FakeComm(32767), 0, spec, 2)
    with pytest.raises(ValueError, match="transport must be one of"):
        PipeChannel(FakeComm(32767), 1, spec, 2, transport="rdma")
    with pytest.raises(ValueError, match="must start with a known batch size"):
        PipeChannel(FakeComm(32767), 1, [((None, 3), "float32")], 2)
    channel = PipeChannel(FakeComm(32767), 1, spec, 2)
    with pytest.raises(ValueError, match="micro-batch 2 is outside"):
        channel.recv(2, FORWARD)
    with pytest.raises(ValueError, match="direction must be"):
        channel.recv(0, "sideways")
    with pytest.raises(ValueError, match=r"does not fit the boundary spec \(2, 3\) float32"):
        channel.isend([tf.zeros((3, 3))], 0, FORWARD)
    with pytest.raises(ValueError, match="does not fit"):
        channel.isend([tf.zeros((2, 3), tf.float64)], 0, FORWARD)


def test_boundary_specs_accept_unknown_dimensions_after_the_batch():
    hidden = BoundarySpec.of(((8, None, 32), "float32"))
    assert hidden.shape == (8, None, 32) and hidden.max_batch == 8 and hidden.dynamic
    mask = BoundarySpec.of(tf.TensorSpec((8, None), tf.bool))
    assert mask.dynamic and mask.dtype == tf.bool
    assert not BoundarySpec.of(((8, 16), "int32")).dynamic
    assert hidden.fits((3, 17, 32)) and hidden.fits((8, 0, 32))
    assert not hidden.fits((9, 17, 32)) and not hidden.fits((3, 17, 31))
    assert not hidden.fits((3, 17)) and not mask.fits((3, 17, 1))
    for shape in [(None, 16), (None, None), ()]:
        with pytest.raises(ValueError, match="must start with a known batch size"):
            BoundarySpec.of((shape, "float32"))
    with pytest.raises(ValueError, match="bytes per sample vary per message"):
        hidden.row_bytes  # noqa: B018


class RecordingComm(FakeComm):
    """Records the nonblocking sends and receives a channel posts, without sending anything."""

    def __init__(self, tag_ub=2**31 - 1):
        super().__init__(tag_ub)
        self.sends, self.receives = [], []

    def Isend(self, message, dest, tag):
        self.sends.append((tag, np.array(message[0], copy=True)))
        return object()

    def Irecv(self, message, source, tag):
        self.receives.append((tag, message[0]))
        return object()


def test_only_dynamic_tensors_send_a_shape_header_in_its_own_tag_space():
    specs = [((4, None, 3), "float32"), ((4, None), "int32"), ((4, 5), "float32")]
    channel = PipeChannel(RecordingComm(), 1, specs, 3, backward_specs=[specs[2]])
    assert channel.dynamic and header_tag(1, 0, FORWARD, 3, 3) == 18 + message_tag(1, 0, FORWARD, 3)
    tensors = [tf.ones((2, 7, 3)), tf.ones((2, 7), tf.int32), tf.ones((2, 5))]
    channel.isend(tensors, 1, FORWARD)
    data = [message_tag(1, i, FORWARD, 3) for i in range(3)]
    headers = [header_tag(1, i, FORWARD, 3, 3) for i in range(2)]
    sent = channel.comm.sends
    assert [tag for tag, _ in sent] == [headers[0], data[0], headers[1], data[1], data[2]]
    assert sent[0][1].dtype == np.int64 and sent[0][1].tolist() == [2, 7, 3]
    assert sent[2][1].tolist() == [2, 7]
    assert min(headers) > max(message_tag(2, 2, d, 3) for d in DIRECTIONS)  # above every data tag
    # irecv posts the headers of dynamic tensors and the data of static ones, nothing more.
    channel.irecv(1, FORWARD)
    assert [tag for tag, _ in channel.comm.receives] == [headers[0], headers[1], data[2]]
    assert channel.receive_buffer(1, FORWARD, 0) is None  # sized by its first header
    with pytest.raises(ValueError, match=r"does not fit the boundary spec \(4, None, 3\)"):
        channel.isend([tf.ones((2, 7, 4)), *tensors[1:]], 0, FORWARD)

    # A static channel sends exactly one message per tensor, as before.
    static = PipeChannel(RecordingComm(), 1, [specs[2]], 3)
    static.isend([tf.ones((4, 5))], 2, FORWARD)
    static.irecv(2, FORWARD)
    assert not static.dynamic
    assert [tag for tag, _ in static.comm.sends] == [message_tag(2, 0, FORWARD, 1)]
    assert [tag for tag, _ in static.comm.receives] == [message_tag(2, 0, FORWARD, 1)]

    # Headers double the tags a dynamic channel needs, checked against TAG_UB.
    PipeChannel(FakeComm(32767), 1, [specs[0]], 8192)
    with pytest.raises(ValueError, match=r"need tag 32771 \(shape headers included\)"):
        PipeChannel(FakeComm(32767), 1, [specs[0]], 8193)
    PipeChannel(FakeComm(32767), 1, [specs[2]], 16384)


def test_batch_size_is_read_from_the_message_length():
    spec = BoundarySpec.of(((8, 3, 2), "bfloat16"))
    assert spec.row_bytes == 12 and spec.max_batch == 8
    assert batch_from_bytes(12 * 5, spec) == 5 and batch_from_bytes(0, spec) == 0
    with pytest.raises(RuntimeError, match="not a whole number"):
        batch_from_bytes(13, spec)
    assert BoundarySpec.of(tf.TensorSpec((4, 2), tf.int8)).row_bytes == 2


def test_gpu_tensors_take_the_dlpack_adapter_path_only_with_a_cuda_aware_mpi():
    gpu, cpu = "/job:localhost/replica:0/task:0/device:GPU:0", "/job:localhost/device:CPU:0"
    assert dlpack.uses_device_path(gpu, "auto", True) and dlpack.uses_device_path(cpu, "device")
    assert not dlpack.uses_device_path(gpu, "auto", False)  # staged (tests/test_gpu_transport)
    assert not dlpack.uses_device_path(cpu, "auto") and not dlpack.uses_device_path(gpu, "host")
    assert not dlpack.uses_device_path(None, "device")  # numpy arrays: buffer protocol
    assert dlpack.tensor_device(np.ones(2)) is None
    assert dlpack.tensor_device(tf.ones(2)).endswith("CPU:0")
    assert isinstance(dlpack.mpi_send_buffer(tf.ones(2), True)[0], dlpack.DLPackAdapter)
    assert not isinstance(dlpack.mpi_send_buffer(tf.ones(2), False)[0], dlpack.DLPackAdapter)


def test_receives_land_on_the_gpu_when_tf_has_one(monkeypatch):
    fake_gpu = tf.config.LogicalDevice("/job:localhost/replica:0/task:0/device:GPU:0", "GPU")
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: [fake_gpu])
    assert dlpack.default_device() == fake_gpu.name
    channel = PipeChannel(FakeComm(32767), 1, [((2, 3), "float32")], 2, cuda_aware=True)
    assert channel.receives_on_device and channel.device == fake_gpu.name
    # Not CUDA-aware: host buffers, then copied to the GPU (tests/test_gpu_transport.py).
    staged = PipeChannel(FakeComm(32767), 1, [((2, 3), "float32")], 2, transport="host")
    assert not staged.receives_on_device and staged.stages_receives


def test_adapter_offers_unversioned_dlpack_that_mpi4py_accepts():
    """mpi4py through the adapter, in one process: send and receive into TF-owned memory."""
    source = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3), tf.bfloat16)
    target = dlpack.device_empty((2, 3), tf.bfloat16, "/CPU:0")
    adapter = dlpack.DLPackAdapter(source)
    assert adapter.__dlpack_device__() == (1, 0)  # kDLCPU
    with pytest.raises(TypeError):
        adapter.__dlpack__(max_version=(1, 0))  # why mpi4py falls back to the legacy capsule
    request = MPI.COMM_SELF.Isend(dlpack.mpi_send_buffer(source, True), 0, 0)
    MPI.COMM_SELF.Recv([dlpack.DLPackAdapter(target), MPI.BYTE], 0, 0)
    request.Wait()
    np.testing.assert_array_equal(np.asarray(target), np.asarray(source))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16, tf.int8, tf.bool])
def test_host_buffers_are_aligned_and_wrapped_without_copy(dtype):
    buffer = dlpack.aligned_empty((3, 5), dlpack.storage_dtype(dtype))
    assert buffer.ctypes.data % dlpack.ALIGNMENT == 0
    buffer[...] = 0
    tensor = dlpack.wrap_host_buffer(buffer, dtype)
    assert tensor.dtype == dtype and tensor.shape == (3, 5)
    assert np.shares_memory(tensor._numpy(), buffer)
    buffer.view(dtype.as_numpy_dtype)[...] = 1  # the tensor is the buffer
    assert np.asarray(tf.cast(tensor, tf.float32)).sum() == 15


def test_unaligned_buffers_are_refused_rather_than_crashing_tf():
    raw = dlpack.aligned_empty((80,), np.uint8)
    with pytest.raises(ValueError, match="not 64-byte aligned"):
        dlpack.wrap_host_buffer(raw[4:68].view(np.float32), tf.float32)


def test_buckets_group_by_dtype_align_offsets_and_respect_the_size():
    specs = [((3,), "float32"), ((2,), "float64"), ((5,), "float16"), ((100,), "float32")]
    slots, buckets = plan_buckets(specs, bucket_bytes=64)
    assert [b.dtype for b in buckets] == [np.float32, np.float64, np.float32]
    assert [(s.bucket, s.offset) for s in slots] == [(0, 0), (1, 0), (0, 16), (2, 0)]
    assert buckets[0].indices == [0, 2] and buckets[2].indices == [3]  # bucket 0 full at 84 B
    assert all((s.offset * buckets[s.bucket].dtype.itemsize) % 64 == 0 for s in slots)
    _, one = plan_buckets(specs, bucket_bytes=2**20)
    assert len(one) == 2  # one bucket per reduction dtype
    assert reduction_dtype(tf.float16) == np.float32 and reduction_dtype("int32") == np.int32


def test_reducer_on_one_rank_is_a_no_op_and_validates():
    grads = [np.ones((2, 2), np.float32), tf.ones(3)]
    reducer = GradientReducer(MPI.COMM_SELF)
    assert all(r is g for r, g in zip(reducer.reduce(grads), grads, strict=True))
    assert reducer.mpi_calls == 0
    with pytest.raises(ValueError, match="op must be one of"):
        GradientReducer(MPI.COMM_SELF, op="max")
    with pytest.raises(ValueError, match="mean needs floats"):
        GradientReducer(MPI.COMM_SELF, [((2,), "int32")])
    with pytest.raises(ValueError, match="expected 2 gradients"):
        reducer.reduce(grads[:1])
    with pytest.raises(RuntimeError, match="needs specs"):
        GradientReducer(MPI.COMM_SELF).start(0, grads[0])


def test_comm_package_never_imports_keras():
    for path in COMM_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "keras" or n.startswith(("keras.", "tf_keras")) for n in names), (
                f"{path.name} imports {names}"
            )


# ---- under mpirun ------------------------------------------------------------------------


class _Clock:
    """`time.monotonic` and `time.sleep` for `idle`: sleeping moves the clock."""

    def __init__(self, yields_take: float):
        self.now, self.sleeps, self.yields_take = 0.0, [], yields_take

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    def sched_yield(self):
        self.now += self.yields_take


@pytest.mark.parametrize("sharing", [False, True])
def test_a_wait_spins_with_a_core_per_rank_and_backs_off_when_sharing(monkeypatch, sharing):
    clock = _Clock(yields_take=1e-4)
    monkeypatch.setattr(idle.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(idle.time, "sleep", clock.sleep)
    monkeypatch.setattr(idle.os, "sched_yield", clock.sched_yield)
    pause = idle.Idle(sharing)
    for _ in range(40):
        pause()
    if not sharing:
        assert clock.sleeps == []  # full-speed polling, whatever the wait's length
        return
    spun = clock.now - sum(clock.sleeps)
    assert idle.SPIN_SECONDS <= spun <= idle.SPIN_SECONDS + 2e-4  # then the sleeps start
    assert clock.sleeps[0] == idle.FIRST_SLEEP_SECONDS
    longest = idle.LONGEST_SLEEP_SECONDS
    doubled = [b == min(2 * a, longest) for a, b in itertools.pairwise(clock.sleeps)]
    assert all(doubled) and clock.sleeps[-1] == longest


@pytest.mark.parametrize(("setting", "expected"), [("1", True), ("0", False), (None, False)])
def test_open_mpis_yield_setting_decides_whether_ranks_share_cores(monkeypatch, setting, expected):
    """One process on its own cores shares none; Open MPI's MCA parameter overrides that."""
    if setting is None:
        monkeypatch.delenv(idle.YIELD_ENV, raising=False)
    else:
        monkeypatch.setenv(idle.YIELD_ENV, setting)
    assert idle.shares_cores(MPI.COMM_SELF) is expected


@pytest.mark.mpi
def test_topology_communicators(ranks):
    for r in ranks:
        t = r["topology"]
        assert t["sizes"] == [2, 2]
        assert (t["stage"], t["replica"]) == (r["rank"] % 2, r["rank"] // 2)
        assert (
            t["pipeline_members"]
            == t["expected_pipeline"]
            == [2 * t["replica"], 2 * t["replica"] + 1]
        )
        assert t["stage_members"] == t["expected_stage"] == [t["stage"], t["stage"] + 2]
        assert t["pipeline_rank"] == t["stage"] and t["stage_comm_rank"] == t["replica"]
        assert t["prev_next"] == ([None, 1] if t["stage"] == 0 else [0, None])
        assert r["bad_grid_error"].startswith("4 ranks cannot form 3 partitions x 1 replicas")


@pytest.mark.mpi
def test_a_failure_notice_frees_ranks_blocked_in_a_receive_and_in_collectives(ranks):
    """Rank 3 announced; rank 0 left a receive, ranks 1 and 2 collectives rank 3 never
    entered, each naming rank 3 and the first line of its error; then all agreed it failed."""
    for r in ranks:
        failed = r["failure"]
        expected = "announced" if r["rank"] == 3 else "rank 3 failed: RuntimeError: disk full"
        assert failed["left"] == expected, (r["rank"], failed)
        assert failed["all_failed"] is True


def test_a_failure_is_said_in_one_line():
    error = ValueError(
        "Graph execution error:\n\nDetected at node x defined at:\n  File a\n"
        "bad value : Tensor had NaN values\n\t [[{{node x}}]] [Op:f]"
    )
    assert failure._first_line(error) == "ValueError: bad value : Tensor had NaN values"
    assert failure._first_line(KeyError("k")) == "KeyError: 'k'"
    assert failure._first_line(RuntimeError("")) == "RuntimeError: "


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["host", "device"])
def test_pipeline_p2p_values_order_and_small_last_batch(ranks, transport):
    for r in ranks:
        p2p = r[f"p2p_{transport}"]
        assert p2p["values_ok"] == [True] * 6  # 3 micro-batches x 2 steps, out of order
        assert p2p["directions_ok"] == [True, True]
        # Buffers are allocated in the first step (one set per micro-batch) and then reused.
        assert p2p["allocations_after_step0"] == p2p["allocations_after_step1"] == 3
        if r["topology"]["stage"] == 1:
            assert p2p["small_batch_shape"] == [[2, 3], [2, 2, 2], [2], [2, 5]]
            assert p2p["held_intact"] and p2p["held_distinct"] and p2p["held_reallocated"] == 1
            assert "arrived with batch sizes [2] but 4 was expected" in p2p["wrong_batch_error"]


@pytest.mark.mpi
def test_pipeline_receives_are_zero_copy(ranks):
    for r in ranks:
        assert all(shares for _, shares in r["p2p_host"]["zero_copy"])
        # The device path shares memory too, except TF's slice of the smaller last batch.
        assert all(shares == (batch == 4) for batch, shares in r["p2p_device"]["zero_copy"])
        if r["topology"]["stage"] == 1:
            assert r["p2p_host"]["mutation_visible"] == [True] * 3


@pytest.mark.mpi
def test_large_messages_travel_from_huge_pages(ranks):
    expected = hugepages_expected()
    for r in ranks:
        h = r["huge_pages"]
        assert h["values_ok"] == [True] * 3
        assert h["enabled"] == expected, h["reason"]
        if expected:
            assert h["buffer_alignment"] == 0  # receive buffers start on a huge page
            # Receive buffers and the first sends collapse pages; later steps mostly reuse them.
            assert h["collapsed"][0] >= 3
        else:
            assert h["collapsed"] == [0, 0, 0]


@pytest.mark.mpi
def test_fused_allreduce_matches_numpy(ranks):
    for r in ranks:
        a = r["allreduce"]
        for step in range(2):
            assert a[f"small_buckets_error_{step}"] < 1e-12
            assert a[f"small_buckets_dtypes_{step}"] and a[f"small_buckets_shapes_{step}"]
        num_buckets, calls, num_grads = a["small_buckets"]
        assert 1 < num_buckets < num_grads and calls == 2 * num_buckets  # fused, two steps
        assert a["small_buckets_allocations"] == num_buckets  # reused in the second step
        assert a["held_error"] < 1e-12 and a["held_reallocated"] == num_buckets
        assert a["background_error"] < 1e-12
        assert a["background_calls"][1] == 2 * a["background_calls"][0]
        assert a["world_sum_error"] < 1e-5 and a["world_sum_tensors"] and a["world_views_bucket"]
        assert a["world_calls"] == [2, 2]  # 7 gradients, 2 dtypes: 2 MPI calls
        assert a["async_calls"] == [1, 2, 3, 4]  # each bucket started as soon as it filled
        assert a["async_none"] and a["async_dtypes"] == ["float16", "bfloat16", "float32"]
        assert a["async_error"] < 1e-2
        assert a["finish_missing_error"] == "finish() before gradients [1, 2, 3] were started"
        assert a["single_rank_identity"] and a["single_rank_calls"] == 0
        # Flat path: exact sums in the tensor's own memory, one call per 64-byte slice.
        assert a["flat_error"] < 1e-5 and a["flat_in_place"]
        assert a["flat_tail_0"] and a["flat_tail_1"] and a["flat_mean_tail"]
        calls, slices_per_step = a["flat_calls"]
        assert calls == 2 * slices_per_step


# ---- under mpirun, 2 ranks: unknown sequence length -------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["host", "device"])
def test_dynamic_shapes_arrive_exactly_with_buffers_reused_grown_and_held(dynamic_ranks, transport):
    lengths = [7, 3, 12, 12, 1]
    for r in dynamic_ranks:
        d = r[transport]
        receives_forward = r["rank"] == 1
        assert d["values_ok"] == [[True] * 3] * 5
        for length, shapes in zip(lengths, d["shapes"], strict=True):
            for batch, got in zip([4, 4, 2], shapes, strict=True):
                forward = [[batch, length, 3], [batch, length], [batch, 5]]
                assert got == (forward if receives_forward else [forward[0], forward[2]])
        # Both receive styles in both directions (rank 1 receives forward, rank 0 backward).
        assert sorted(set(d["modes"])) == ["irecv", "recv"]
        if transport == "host":
            assert d["zero_copy"] == [True] * 5
        # Step 0 allocates a set per slot; step 1 (shorter) reuses them; step 2 (longer) grows
        # slots 1-2 and gives slot 0 a fresh set (a step-1 tensor there is still held); step 3
        # (same length) reuses slots 1-2 and again refreshes slot 0 (held); step 4 reuses all.
        assert d["allocations"] == [3, 3, 6, 7, 7]
        assert d["capacity"] == [[4 * n * 3] * 3 for n in (7, 7, 12, 12, 12)]
        static = len(d["reused"][0][0]) - 1  # index of the static tensor
        fresh, kept = [False] * (static + 1), [True] * (static + 1)
        grown = [False] * static + [True]
        assert d["reused"] == [[kept] * 3, [fresh, grown, grown], [fresh, kept, kept], [kept] * 3]
        assert d["held_intact"] == [True, True]  # never overwritten, whether grown or reused
        assert d["dynamic_nothing_pending"] and d["static_nothing_pending"]
        if receives_forward:
            assert d["wrong_batch_error"] == (
                "micro-batch 2 (forward) arrived with batch sizes [2] but 4 was expected"
            )
            assert d["after_error_ok"]  # the refused message was still drained
            assert d["static_ok"] and d["static_allocations"] == 1

"""ScalingProfiler: step breakdowns, bubble math, clock alignment, timeline, Gantt chart, report.

Pure parts run on synthetic steps from the schedule simulator; one 2-rank and one 4-rank
launch check what the profiler writes during a real `hf.fit`.
"""

import json
import os
import queue
import struct
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.util import tensor_util

import hyparflow as hf
from hyparflow.callbacks import breakdown, clock, gantt, report, scalars, summary
from hyparflow.callbacks import timeline as tl
from hyparflow.callbacks.aggregate import job_step
from hyparflow.callbacks.breakdown import StepBreakdown
from hyparflow.callbacks.profiler import ScalingProfiler
from hyparflow.cli import main
from hyparflow.engine import events
from hyparflow.schedule import make_schedule, simulate, theoretical_bubble
from tests.support.cases import Case, run_cases, selected
from tests.support.mpirun import REPO
from tests.support.profiler import simulated_steps

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


# --- one rank's step ---------------------------------------------------------------------
def test_breakdown_sums_spans_by_kind_and_leaves_the_rest_idle():
    spans = (
        events.Span("recv", 0, 0, 1.000, 1.002),
        events.Span("forward", 0, 0, 1.002, 1.005),
        events.Span("forward", 0, 1, 1.006, 1.009),
        events.Span("backward", 0, 1, 1.009, 1.015),
        events.Span("allreduce", 0, None, 1.015, 1.016),
        events.Span("optimizer", 0, None, 1.016, 1.018),
    )
    b = breakdown.breakdown(events.StepRecord(4, 1.0, 1.020, 256, 2, spans))
    assert b.step == 4 and b.samples == 256 and b.microbatches == 2
    assert b.seconds["forward"] == pytest.approx(0.006)
    assert b.seconds["send"] == 0.0
    assert b.compute == pytest.approx(0.012)
    assert b.idle == pytest.approx(0.003)  # 1 ms between the forwards, 2 ms at the end
    assert b.pipeline_time == pytest.approx(0.017)
    assert b.bubble() == pytest.approx(1 - 0.012 / 0.017)
    assert b.bubble(makespan=0.024) == pytest.approx(0.5)
    assert b.throughput == pytest.approx(256 / 0.020)


def test_a_step_known_only_from_callbacks_has_no_split():
    b = breakdown.wall_only(0, 2.0, 2.5, None)
    assert b.seconds is None and b.compute is None and b.idle is None and b.bubble() is None
    assert b.throughput is None
    assert breakdown.wall_only(0, 2.0, 2.5, 100).throughput == 200.0
    assert set(scalars.rank_values(breakdown.wall_only(0, 2.0, 2.5, 100))) == {
        scalars.STEP_MS,
        scalars.THROUGHPUT,
    }


# --- the pipeline bubble -----------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 4), (2, 8), (4, 4), (4, 12)])
def test_equal_stages_measure_the_formula(schedule, stages, microbatches):
    ranks = [
        breakdown.breakdown(r)
        for r in simulated_steps(
            schedule,
            stages,
            microbatches,
            allreduce=0.003,
            optimizer=0.002,  # not pipeline
        )
    ]
    job = job_step(ranks, [0] * stages, stages)
    formula = theoretical_bubble(stages, microbatches)
    assert job.bubble_theoretical == pytest.approx(formula)
    assert job.bubble_measured == pytest.approx(formula, abs=1e-9)


def test_unequal_stages_measure_what_the_simulator_predicts():
    f, b = [0.001, 0.003], [0.002, 0.004]
    # rebuild with uneven stages by simulating directly
    sim = simulate(make_schedule("1f1b", 2, 4), forward_time=f, backward_time=b)
    ranks = []
    for stage in range(2):
        busy = 4 * (f[stage] + b[stage])
        seconds = dict.fromkeys(events.KINDS, 0.0)
        seconds.update(forward=4 * f[stage], backward=4 * b[stage])
        seconds["recv"] = sim.makespan - busy
        ranks.append(StepBreakdown(0, 0.0, sim.makespan, 64, 4, seconds))
    job = job_step(ranks, [0, 0], 2)
    assert job.bubble_measured == pytest.approx(sim.bubble)
    assert job.bubble_measured > job.bubble_theoretical + 0.05


def test_a_stage_that_finishes_early_is_charged_the_pipelines_makespan():
    """The last stage ends its step before the first stage's drain; its own phase is shorter
    than the pipeline's, and only the makespan gives the formula."""
    records = simulated_steps("gpipe", 2, 4)
    last = records[1]
    last_end = max(s.end for s in last.spans if s.kind == "backward")
    cut = events.StepRecord(0, last.start, last_end, 64, 4, last.spans[:-2])  # leaves early
    ranks = [breakdown.breakdown(records[0]), breakdown.breakdown(cut)]
    job = job_step(ranks, [0, 0], 2)
    assert job.makespans == (ranks[0].pipeline_time, ranks[0].pipeline_time)
    assert job.bubble_measured == pytest.approx(theoretical_bubble(2, 4))
    assert ranks[1].bubble() < theoretical_bubble(2, 4) - 0.05  # its own view undercounts


def test_each_replica_has_its_own_makespan():
    fast = [breakdown.breakdown(r) for r in simulated_steps("gpipe", 2, 4, forward=0.001)]
    slow = [breakdown.breakdown(r) for r in simulated_steps("gpipe", 2, 4, forward=0.004)]
    job = job_step([*fast, *slow], [0, 0, 1, 1], 2)
    assert job.makespans[0] == job.makespans[1] < job.makespans[2] == job.makespans[3]
    assert job.bubble_measured == pytest.approx(theoretical_bubble(2, 4))


def test_a_replica_without_microbatches_has_no_bubble():
    ranks = [breakdown.breakdown(r) for r in simulated_steps("gpipe", 2, 2)]
    empty = StepBreakdown(0, 0.0, 0.001, 64, 0, dict.fromkeys(events.KINDS, 0.0))
    job = job_step([*ranks, empty, empty], [0, 0, 1, 1], 2)
    assert job.bubbles[2:] == (None, None)
    assert job.bubble_measured == pytest.approx(theoretical_bubble(2, 2))
    assert job.bubble_theoretical == pytest.approx(theoretical_bubble(2, 2))


def test_job_step_pace_throughput_and_efficiency():
    ranks = [breakdown.breakdown(r) for r in simulated_steps("gpipe", 2, 4, samples=96)]
    ranks[1] = StepBreakdown(0, 0.0, ranks[0].wall * 2, 96, 4, ranks[1].seconds)
    job = job_step(ranks, [0, 0], 2, baseline=100.0)
    assert job.wall == ranks[1].wall
    assert job.throughput == pytest.approx(96 / ranks[1].wall)
    assert job.efficiency == pytest.approx(job.throughput / 200.0)
    assert job.mean_wall == pytest.approx(1.5 * ranks[0].wall)
    with pytest.raises(ValueError, match="different steps"):
        job_step([ranks[0], StepBreakdown(1, 0.0, 1.0, 96, 4, None)], [0, 0], 2)


# --- scalars -----------------------------------------------------------------------------
def test_every_documented_tag_has_a_value():
    ranks = [breakdown.breakdown(r) for r in simulated_steps("gpipe", 2, 4)]
    job = job_step(ranks, [0, 0], 2, baseline=50.0)
    assert set(scalars.rank_values(ranks[0], job.bubbles[0])) == set(scalars.RANK_TAGS)
    assert set(scalars.job_values(job)) == {*scalars.AGGREGATE_TAGS, scalars.EFFICIENCY}
    values = scalars.rank_values(ranks[0], 0.25)
    assert values[scalars.COMPUTE_MS] == pytest.approx(1e3 * ranks[0].compute)
    assert values[scalars.BUBBLE_MEASURED] == 0.25
    assert values[scalars.IDLE_MS] == pytest.approx(1e3 * ranks[0].idle)


# --- tensor parallelism ------------------------------------------------------------------
def test_recorder_takes_spans_from_other_threads_into_the_open_microbatch():
    recorder = events.Recorder()
    recorder.add(events.TENSOR, 0.0, 1.0)  # outside a step (evaluation): dropped

    def collective():  # as Traffic.listener, on a TensorFlow executor thread
        start = time.perf_counter()
        recorder.add(events.TENSOR, start, time.perf_counter())

    with recorder.step(samples=8, microbatches=2):
        for k in range(2):
            with recorder.span(events.FORWARD, microbatch=k):
                thread = threading.Thread(target=collective)
                thread.start()
                thread.join()
        with recorder.span(events.OPTIMIZER):
            collective()
    (record,) = recorder.take()
    tensor = [s for s in record.spans if s.kind == events.TENSOR]
    assert [(s.step, s.microbatch) for s in tensor] == [(0, 0), (0, 1), (0, None)]
    forwards = [s for s in record.spans if s.kind == events.FORWARD]
    # the last tensor span is the optimizer's, outside every forward
    assert all(
        f.start <= t.start <= t.end <= f.end for f, t in zip(forwards, tensor[:2], strict=True)
    )


def _with_tensor_spans(record, share=0.25):
    """`record` with a tensor collective in the middle of each forward and backward span."""
    inner = []
    for s in record.spans:
        if s.kind in (events.FORWARD, events.BACKWARD):
            middle, half = (s.start + s.end) / 2, share * s.duration / 2
            inner.append(
                events.Span(events.TENSOR, s.step, s.microbatch, middle - half, middle + half)
            )
    return events.StepRecord(
        record.step,
        record.start,
        record.end,
        record.samples,
        record.microbatches,
        record.spans + tuple(inner),
    )


def test_tensor_time_is_its_own_category_and_not_compute(tmp_path):
    plain = simulated_steps("gpipe", 2, 4, allreduce=0.001, optimizer=0.002)
    records = [_with_tensor_spans(r) for r in plain]
    before = [breakdown.breakdown(r) for r in plain]
    ranks = [breakdown.breakdown(r, inner=("tensor",)) for r in records]
    # compute gives a quarter to tensor; idle is unchanged
    for b, a in zip(ranks, before, strict=True):
        assert b.seconds["tensor"] == pytest.approx(0.25 * a.compute)
        assert b.compute == pytest.approx(0.75 * a.compute)
        assert b.idle == pytest.approx(a.idle)
        assert sum(b.seconds.values()) == pytest.approx(sum(a.seconds.values()))
    job = job_step(ranks, [0, 0], 2)
    values, mean = scalars.rank_values(ranks[0], job.bubbles[0]), scalars.job_values(job)
    assert set(values) == {*scalars.RANK_TAGS, scalars.TENSOR_MS}
    assert set(mean) == {*scalars.AGGREGATE_TAGS, scalars.TENSOR_MS}
    assert values[scalars.TENSOR_MS] == pytest.approx(1e3 * ranks[0].seconds["tensor"])
    assert values[scalars.COMPUTE_MS] == pytest.approx(1e3 * ranks[0].compute)
    assert mean[scalars.TENSOR_MS] == pytest.approx(500 * sum(b.seconds["tensor"] for b in ranks))
    # Without tensor parallelism nothing is added; with it, a rank without collectives has 0.
    assert "tensor" not in before[0].seconds and scalars.TENSOR_MS not in scalars.job_values(
        job_step(before, [0, 0], 2)
    )
    assert breakdown.breakdown(plain[0], inner=("tensor",)).seconds["tensor"] == 0.0

    layout = {**LAYOUT, "kind": "tensor", "tensor": 2}
    result = _summary_of([[r] for r in records], layout)
    ms = result["ranks"][0]["ms_per_step"]
    assert ms["tensor"] == pytest.approx(1e3 * ranks[0].seconds["tensor"])
    assert ms["compute"] == pytest.approx(1e3 * ranks[0].compute)
    assert result["job"]["ms_per_step"]["tensor"] > 0
    text = report.format_report(result)
    assert "2 stages x 1 replica x 2 tensor shards" in text
    header = next(line.split() for line in text.splitlines() if line.startswith("rank"))
    assert header[header.index("compute") + 1] == "tensor"
    plain_text = report.format_report(_summary_of([[r] for r in plain], LAYOUT))
    assert "tensor" not in plain_text

    trace = tl.to_trace([({"rank": r, "stage": r, "replica": 0}, [records[r]]) for r in (0, 1)])
    back = tl.read_tracks(trace)
    for track, record in zip(back, records, strict=True):
        inner = [s for s in track.slices if s.kind == "tensor"]
        assert len(inner) == 8 and all(s.name == f"tensor {s.microbatch}" for s in inner)
        assert tl.idle_gaps(record) == tl.idle_gaps(plain[track.rank])  # nested: no new gaps
    assert _png_size(gantt.draw(trace, str(tmp_path / "tensor.png")))


# --- the summary -------------------------------------------------------------------------
def _summary_of(steps_per_rank, layout, baseline=None):
    ranks = [
        {"rank": r, "stage": r % layout["stages"], "replica": r // layout["stages"]}
        for r in range(len(steps_per_rank))
    ]
    run = summary.RunSummary(layout, ranks, baseline)
    for step_ranks in zip(*steps_per_rank, strict=True):
        bs = [breakdown.breakdown(r) for r in step_ranks]
        replicas = [info["replica"] for info in ranks]
        run.add(job_step(bs, replicas, layout["stages"], baseline), bs)
    return run.to_dict()


LAYOUT = {
    "world_size": 2,
    "kind": "model",
    "stages": 2,
    "replicas": 1,
    "microbatches": 4,
    "schedule": "gpipe",
}


def test_summary_leaves_out_the_first_step_at_each_batch_size():
    traced = simulated_steps("gpipe", 2, 4, forward=0.5, step=0)  # tracing: slow
    steady = [simulated_steps("gpipe", 2, 4, step=s, start=s) for s in (1, 2, 3)]
    last = simulated_steps("gpipe", 2, 4, forward=0.3, step=4, start=4, samples=40)
    per_step = [traced, *steady, last]
    result = _summary_of([[s[r] for s in per_step] for r in range(2)], LAYOUT, baseline=10.0)
    assert result["steps"] == {"recorded": 5, "summarized": 3, "warmup_excluded": [0, 4]}
    job = result["job"]
    assert job["ms_per_step"]["step"] == pytest.approx(1e3 * (steady[0][0].end - 1))
    assert job["bubble_measured"] == pytest.approx(0.2)
    assert job["bubble_theoretical"] == pytest.approx(0.2)
    assert job["bubble_simulated"] == pytest.approx(0.2)
    assert job["efficiency"] == pytest.approx(job["throughput"] / 20.0)
    assert [r["steps"] for r in result["ranks"]] == [3, 3]
    ms = result["ranks"][0]["ms_per_step"]
    assert ms["compute"] == pytest.approx(ms["forward"] + ms["backward"])
    assert ms["p2p_wait"] == ms["recv"]


def test_summary_of_warmup_steps_only_uses_them():
    result = _summary_of([[r] for r in simulated_steps("gpipe", 2, 4)], LAYOUT)
    assert result["steps"] == {"recorded": 1, "summarized": 1, "warmup_excluded": []}
    assert result["job"]["efficiency"] is None


# --- clocks ------------------------------------------------------------------------------
class _ThreadComm:
    """Two ranks in two threads: just enough of an mpi4py communicator for clock_offset."""

    def __init__(self, rank, boxes):
        self.rank, self.boxes = rank, boxes

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return 2

    def send(self, obj, dest, tag):
        self.boxes[self.rank, dest].put(obj)

    def recv(self, source, tag):
        return self.boxes[source, self.rank].get(timeout=10)

    def scatter(self, values, root):
        if self.rank == root:
            self.send(values[1], 1, 0)
            return values[0]
        return self.recv(root, 0)


def test_clock_offset_recovers_a_shifted_clock():
    boxes = {(a, b): queue.Queue() for a in range(2) for b in range(2)}
    results = {}

    def run(rank, shift):
        results[rank] = clock.ping_pong_offset(
            _ThreadComm(rank, boxes), clock=lambda: time.perf_counter() + shift
        )

    threads = [
        threading.Thread(target=run, args=(0, 0.0)),
        threading.Thread(target=run, args=(1, 123.0)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results[0] == 0.0
    assert results[1] == pytest.approx(123.0, abs=2e-3)  # within a round trip


def test_offset_from_rounds_trusts_the_tightest_round():
    rounds = [(10.0, 14.0, 12.0), (20.0, 25.0, 20.2), (30.0, 36.0, 31.0)]
    assert clock.offset_from_rounds(rounds) == pytest.approx(4.9)
    record = simulated_steps("gpipe", 2, 1, start=104.9)[1]
    moved = tl.aligned(record, 4.9)
    assert moved.start == pytest.approx(100.0)
    assert moved.spans[0].start == pytest.approx(record.spans[0].start - 4.9)


# --- timeline ----------------------------------------------------------------------------
def _tracks(stages=2, replicas=1, steps=2, microbatches=4, schedule="1f1b"):
    tracks = {}
    for step in range(steps):
        for q in range(replicas):
            for s, record in enumerate(
                simulated_steps(
                    schedule,
                    stages,
                    microbatches,
                    step=step,
                    start=10.0 + step,
                    allreduce=0.001,
                    optimizer=0.002,
                )
            ):
                rank = q * stages + s
                info = {"rank": rank, "stage": s, "replica": q}
                tracks.setdefault(rank, (info, []))[1].append(record)
    return [tracks[r] for r in sorted(tracks)]


def test_trace_has_one_track_per_rank_and_every_span():
    tracks = _tracks(stages=2, replicas=2)
    trace = tl.to_trace(tracks, {"stages": 2, "replicas": 2})
    json.loads(json.dumps(trace))  # plain JSON
    names = [e for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert sorted((e["pid"], e["tid"]) for e in names) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in slices) == 0.0
    spans = [e for e in slices if e["cat"] in events.KINDS]
    assert len(spans) == sum(len(r.spans) for _, steps in tracks for r in steps)
    for e in slices:  # every slice nests inside its step on its track
        step = next(
            s
            for s in slices
            if s["cat"] == "step"
            and s["tid"] == e["tid"]
            and s["args"]["step"] == e["args"]["step"]
        )
        assert step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3
    idle = [e for e in slices if e["cat"] == "idle"]
    assert idle and all(e["dur"] >= tl.MIN_IDLE * 1e6 for e in idle)


def test_trace_reads_back_into_tracks():
    tracks = _tracks(stages=2, replicas=1, steps=1, microbatches=3)
    back = tl.read_tracks(tl.to_trace(tracks))
    assert [(t.rank, t.stage, t.replica) for t in back] == [(0, 0, 0), (1, 1, 0)]
    for track in back:
        forwards = sorted(s.microbatch for s in track.slices if s.kind == "forward")
        assert forwards == [0, 1, 2]
        first = next(s for s in track.slices if s.kind == "step")
        assert first.start_ms == pytest.approx(0.0) and first.step == 0


def test_idle_gaps_cover_what_no_span_does():
    spans = (events.Span("forward", 0, 0, 1.0, 2.0), events.Span("backward", 0, 0, 1.5, 3.0))
    record = events.StepRecord(0, 0.0, 5.0, 8, 1, spans)
    assert tl.idle_gaps(record, min_idle=0.01) == [(0.0, 1.0), (3.0, 5.0)]
    assert tl.idle_gaps(record, min_idle=2.5) == []


# --- Gantt chart and report --------------------------------------------------------------
def test_gantt_chart_is_a_png(tmp_path):
    trace = tl.to_trace(
        _tracks(stages=4, steps=3, microbatches=6),
        {"stages": 4, "replicas": 1, "microbatches": 6, "schedule": "1f1b"},
    )
    path = gantt.draw(trace, str(tmp_path / "chart.png"))
    width, height = _png_size(path)
    assert width > 800 and height > 300
    assert "4 stages × 1 replica, 6 micro-batches (1f1b), steps 0–2" in gantt.default_title(
        trace, [0, 1, 2]
    )
    assert gantt.chosen_steps(trace, None, max_steps=2) == [0, 1]
    with pytest.raises(ValueError, match="not in the timeline"):
        gantt.draw(trace, str(tmp_path / "x.png"), steps=[7])


def _synthetic_log_dir(path):
    per_step = [simulated_steps("gpipe", 2, 4, step=s, start=s) for s in range(3)]
    result = _summary_of([[s[r] for s in per_step] for r in range(2)], LAYOUT, baseline=10.0)
    summary.write_summary(result, str(path / summary.SUMMARY_FILE))
    tracks = [({"rank": r, "stage": r, "replica": 0}, [s[r] for s in per_step]) for r in range(2)]
    tl.write(tl.to_trace(tracks, LAYOUT), str(path / tl.TIMELINE_FILE))
    return result


def test_report_prints_a_row_per_rank_and_the_bubble_next_to_the_formula(tmp_path):
    result = _synthetic_log_dir(tmp_path)
    text, png = report.report(str(tmp_path), steps=[1, 2])
    lines = text.splitlines()
    header = next(
        i for i, line in enumerate(lines) if line.split()[:3] == ["rank", "stage", "replica"]
    )
    assert [line.split()[0] for line in lines[header + 1 : header + 4]] == ["0", "1", "job"]
    assert "Pipeline bubble: measured 20.0% vs theoretical (p-1)/(m+p-1) = 20.0%" in text
    assert f"{100 * result['job']['efficiency']:.1f}%" in text
    assert png == str(tmp_path / gantt.GANTT_FILE) and _png_size(png)


def test_cli_report_and_its_errors(tmp_path, capsys):
    _synthetic_log_dir(tmp_path)
    assert main(["report", str(tmp_path), "--png", str(tmp_path / "g.png"), "--steps", "1-2"]) == 0
    out = capsys.readouterr().out
    assert "Profiled run: model parallel, 2 stages x 1 replica" in out and _png_size(
        tmp_path / "g.png"
    )
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "profile.json" in capsys.readouterr().err


# --- the callback on one process ---------------------------------------------------------
def test_arguments_are_checked():
    with pytest.raises(ValueError, match="profile_steps"):
        ScalingProfiler("x", profile_steps=(5, 2))
    with pytest.raises(ValueError, match="timeline"):
        ScalingProfiler("x", timeline="yes")
    with pytest.raises(ValueError, match="baseline_throughput"):
        ScalingProfiler("x", baseline_throughput=0)


def _event_tags(run_dir):
    acc = ea.EventAccumulator(str(run_dir), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}


def test_single_process_fit_writes_step_times(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile("sgd", "mse")
    x, y = np.zeros((40, 4), "float32"), np.zeros((40, 3), "float32")
    profiler = ScalingProfiler(tmp_path, batch_size=10, baseline_throughput=100.0)
    hf.fit(model, x, y, batch_size=10, epochs=2, verbose=0, callbacks=[profiler])
    assert _event_tags(tmp_path / "rank_0") == {
        scalars.STEP_MS: list(range(8)),
        scalars.THROUGHPUT: list(range(8)),
    }
    aggregate_tags = _event_tags(tmp_path / "aggregate")
    assert set(aggregate_tags) == {
        scalars.STEP_MS,
        scalars.THROUGHPUT,
        scalars.BUBBLE_THEORETICAL,
        scalars.EFFICIENCY,
    }
    result = summary.load_summary(str(tmp_path / summary.SUMMARY_FILE))
    assert result["layout"]["kind"] == "single process"
    assert result["steps"] == {"recorded": 8, "summarized": 7, "warmup_excluded": [0]}
    assert not (tmp_path / tl.TIMELINE_FILE).exists()  # no spans, nothing to draw
    text, png = report.report(str(tmp_path))
    assert png is None and "single process" in text and "Pipeline bubble: none" in text


# --- under mpirun ------------------------------------------------------------------------
# models of tests/mpi/profiled_fit.py: two stages of equal cost, wide enough to measure the
# bubble, or narrow
TWO_RANKS = [
    Case("equal_stages_wide", "sgd", "model", partitions=2, microbatches=4),
    Case("equal_stages", "sgd", "data", replicas=2),
    Case("equal_stages_wide", "sgd", "model", partitions=2, microbatches=4, schedule="zero_bubble"),
    Case("equal_stages", "sgd", "model", partitions=2, microbatches=4, schedule="interleaved"),
]
FOUR_RANKS = [
    Case("equal_stages", "sgd", "hybrid", partitions=2, replicas=2, microbatches=2, schedule="1f1b")
]
# collectives inside compute, in the 2-rank launch: tensor parallelism (two Dense pairs split
# column then row), expert parallelism (a Mixtral's experts split over 2 replicas) and
# ZeRO-3's gathers of weights (their waits; the gathers run ahead on a thread)
INNER = [
    Case("dense_pairs", "sgd", "data", tensor=2),
    Case("mixtral", "sgd", "data", replicas=2, experts=2),
    Case("equal_stages_wide", "sgd", "data", replicas=2, microbatches=2, shard_weights=True),
]


@pytest.fixture(scope="module")
def profiled_runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("profiled")
    runs = {}
    for np_, cases in ((2, TWO_RANKS + INNER), (4, FOUR_RANKS)):
        chosen = [c for c in selected(request, TWO_RANKS + INNER + FOUR_RANKS) if c in cases]
        if chosen:
            runs |= run_cases("profiled_fit", np_, chosen, str(root), timeout=300)
    return runs


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", TWO_RANKS + FOUR_RANKS, ids=str)
def test_profiled_fit_writes_every_documented_output(profiled_runs, case):
    ranks = profiled_runs[case.id]
    stages, replicas, microbatches = case.partitions, case.replicas, case.microbatches
    world = stages * replicas
    log_dir = ranks[0]["log_dir"]
    assert all(r["detached"] for r in ranks), "profiling must be off again after fit"
    _assert_tensorboard_runs(log_dir, world)
    tracks = _assert_timeline(log_dir, world, stages, microbatches, case)
    if stages > 1 and case.schedule != "interleaved":  # there, rank 1 receives gradients too
        _assert_clocks_aligned(tracks)
    assert _png_size(os.path.join(log_dir, gantt.GANTT_FILE))
    assert not any(s.kind == "tensor" for t in tracks for s in t.slices)  # no tensor split
    _assert_summary(log_dir, case, stages, microbatches)
    _assert_report_table(log_dir, world, stages, case.schedule)


def _chunks(case) -> int:
    """Model chunks each rank runs (interleaved: virtual_stages, 2 unless given)."""
    return max(case.virtual_stages, 2) if case.schedule == "interleaved" else 1


def _assert_tensorboard_runs(log_dir, world):
    """Every documented tag, every step, every rank; a profile per rank; the aggregate run."""
    steps = list(range(8))  # 4 batches x 2 epochs
    for r in range(world):
        tags = _event_tags(os.path.join(log_dir, f"rank_{r}"))
        assert set(tags) == set(scalars.RANK_TAGS), f"rank {r}"
        assert all(s == steps for s in tags.values()), f"rank {r}"
        profile = os.path.join(log_dir, f"rank_{r}", "plugins", "profile")
        assert any(f.endswith(".xplane.pb") for _, _, fs in os.walk(profile) for f in fs)
    aggregate_tags = _event_tags(os.path.join(log_dir, "aggregate"))
    assert set(aggregate_tags) == {*scalars.AGGREGATE_TAGS, scalars.EFFICIENCY}


def _assert_timeline(log_dir, world, stages, microbatches, case):
    """One track per rank, each step's forward and backward (and, split off it, weight pass) of
    every micro-batch through each of the rank's chunks; the tracks."""
    schedule = case.schedule
    trace = tl.load(os.path.join(log_dir, tl.TIMELINE_FILE))
    tracks = tl.read_tracks(trace)
    assert sorted(t.rank for t in tracks) == list(range(world))
    assert len({(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}) == world
    for t in tracks:
        assert (t.stage, t.replica) == (t.rank % stages, t.rank // stages)
        timeline_steps = sorted({s.step for s in t.slices if s.kind == "step"})
        assert timeline_steps == list(range(1, 8))  # default window, tracing step 0 dropped
        split = schedule == "zero_bubble" and stages > 1
        for kind in ("forward", "backward", "weight") if split else ("forward", "backward"):
            for step in timeline_steps:
                mine = [s for s in t.slices if s.kind == kind and s.step == step]
                done = sorted(s.microbatch for s in mine if s.microbatch is not None)
                expected = sorted(list(range(microbatches)) * _chunks(case))
                assert done == expected, (t.rank, kind, step)
                # Besides: at most one forward of no micro-batch, a later stage packing its
                # parameters while it waits for its first activations (StageRunner.prepare).
                unnamed = len(mine) - len(done)
                assert unnamed <= (1 if kind == "forward" and t.stage > 0 else 0), (t.rank, step)
    return tracks


def _assert_clocks_aligned(tracks):
    """Aligned clocks: a stage receives a micro-batch after it was computed."""
    by_rank = {t.rank: t for t in tracks}
    for step in (1, 2):
        forward_end = {
            s.microbatch: s.start_ms + s.duration_ms
            for s in by_rank[0].slices
            if s.kind == "forward" and s.step == step
        }
        for s in by_rank[1].slices:
            # the last stage only ever receives activations
            if s.kind == "recv" and s.step == step and s.microbatch is not None:
                assert s.start_ms + s.duration_ms >= forward_end[s.microbatch] - 0.5, (
                    f"rank 1 got micro-batch {s.microbatch} of step {step} before rank 0 "
                    "computed it: clocks misaligned"
                )


def _assert_summary(log_dir, case, stages, microbatches):
    """The summary file: no tensor category, the bubble's formula and a measure in range."""
    result = summary.load_summary(os.path.join(log_dir, summary.SUMMARY_FILE))
    assert all("tensor" not in r["ms_per_step"] for r in result["ranks"])
    job = result["job"]
    one_f_one_b = theoretical_bubble(stages, microbatches)
    if case.schedule == "zero_bubble":  # at the measured F, B, W times: a third of 1F1B's if equal
        assert 0.0 < job["bubble_theoretical"] < one_f_one_b
    elif case.schedule == "interleaved":  # v chunks a stage: as if v times the micro-batches
        interleaved = theoretical_bubble(stages, microbatches * _chunks(case))
        assert job["bubble_theoretical"] == pytest.approx(interleaved)
        assert interleaved < one_f_one_b
    else:
        assert job["bubble_theoretical"] == pytest.approx(one_f_one_b)
    assert 0.0 <= job["bubble_measured"] <= 1.0
    if (
        case.model == "equal_stages_wide"
    ):  # equal stages: near the formula, above it by overheads only
        measured, formula = job["bubble_measured"], job["bubble_theoretical"]
        print(f"{case}: bubble measured {measured:.3f}, formula {formula:.3f}")
        # Compute noise on a shared 2-core machine only adds waiting; the bound catches a
        # bubble computed from the wrong times, which lands near 0 or near 1.
        assert job["bubble_theoretical"] - 0.05 <= job["bubble_measured"]
        assert job["bubble_measured"] <= job["bubble_theoretical"] + 0.4


def _assert_report_table(log_dir, world, stages, schedule):
    """`hyparflow report` prints a row per rank and one for the job."""
    cli = subprocess.run(
        [sys.executable, "-m", "hyparflow.cli", "report", log_dir],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert cli.returncode == 0, cli.stderr
    table = [line.split() for line in cli.stdout.splitlines()]
    assert table[3][:6] == ["rank", "stage", "replica", "step", "ms", "compute"]
    assert [row[0] for row in table[4 : 5 + world]] == [*map(str, range(world)), "job"]
    formula = {
        "zero_bubble": "ZB-H1 at these F, B, W times",
        "interleaved": "(p-1)/(2m+p-1)",
    }.get(schedule, "(p-1)/(m+p-1)")
    assert f"theoretical {formula}" in cli.stdout or stages == 1


def _event_values(run_dir):
    """{tag: {step: value}} of a run's scalars."""
    acc = ea.EventAccumulator(str(run_dir), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    return {
        tag: {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
        for tag in acc.Tags()["tensors"]
    }


def _inside(inner, outer, slack_ms=1e-3):
    end, outer_end = inner.start_ms + inner.duration_ms, outer.start_ms + outer.duration_ms
    return outer.start_ms - slack_ms <= inner.start_ms and end <= outer_end + slack_ms


def _assert_inner_spans_inside_compute(track, values, category: str, close: dict):
    """The timeline: every collective of `category` inside the forward or backward that ran
    it, and the scalars' forward and backward are those slices minus the time inside them."""
    r = track.rank
    for step in range(1, 8):  # the timeline's steps
        mine = [s for s in track.slices if s.step == step]
        inner = [s for s in mine if s.kind == category]
        outer = [s for s in mine if s.kind in ("forward", "backward")]
        assert inner and all(any(_inside(s, o) for o in outer) for s in inner), (r, step)
        net = {"forward": 0.0, "backward": 0.0}
        for o in outer:
            within = [s for s in inner if _inside(s, o)]
            # (one stage: forward computes the gradients too, backward has nothing to do)
            assert within or o.kind == "backward", f"rank {r} step {step}: {o.name}"
            assert all(s.microbatch == o.microbatch for s in within)
            net[o.kind] += o.duration_ms - sum(s.duration_ms for s in within)
        inner_ms = sum(s.duration_ms for s in inner)
        assert values[scalars.KIND_MS[category]][step] == pytest.approx(inner_ms, **close)
        for kind in ("forward", "backward"):  # no double counting
            assert values[scalars.KIND_MS[kind]][step] == pytest.approx(net[kind], **close)


def _assert_expert_phases(moved: dict) -> None:
    """Tokens out and results back moved bytes; the experts' compute between them, timed once
    per exchange pair (each block's forward and backward, per micro-batch), moved none."""
    phases = moved["phases"]
    assert list(phases) == ["dispatch", "compute", "combine"], phases
    for phase in ("dispatch", "combine"):
        assert phases[phase]["bytes"] > 0 and phases[phase]["ms"] > 0, phases
    assert phases["compute"]["calls"] == phases["dispatch"]["calls"] > 0, phases
    assert phases["compute"]["bytes"] == 0 and phases["compute"]["ms"] > 0, phases
    # every exchange is counted in the category, besides the routing counts' allreduce
    assert moved["bytes"] >= phases["dispatch"]["bytes"] + phases["combine"]["bytes"]
    assert moved["calls"] >= phases["dispatch"]["calls"] + phases["combine"]["calls"]


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", INNER, ids=str)
def test_tensor_collectives_and_expert_exchanges_are_their_own_category(profiled_runs, case):
    category = "tensor" if case.tensor > 1 else "experts" if case.experts > 1 else "gather"
    kind_ms = scalars.KIND_MS[category]
    ranks = profiled_runs[case.id]
    log_dir = ranks[0]["log_dir"]
    assert all(r["detached"] and r["listener_cleared"] for r in ranks)
    steps = list(range(8))
    close = {"rel": 1e-5, "abs": 1e-4}  # ms: float32 scalars, timeline times rounded to 1 ns
    tracks = {t.rank: t for t in tl.read_tracks(tl.load(os.path.join(log_dir, tl.TIMELINE_FILE)))}
    assert sorted(tracks) == [0, 1]
    for r in (0, 1):
        values = _event_values(os.path.join(log_dir, f"rank_{r}"))
        assert set(values) == {*scalars.RANK_TAGS, kind_ms}, f"rank {r}"
        assert all(sorted(v) == steps for v in values.values()), f"rank {r}"
        for step in steps:
            v = {tag: by_step[step] for tag, by_step in values.items()}
            assert v[kind_ms] > 0, (r, step)
            parts = sum(v[tag] for tag in scalars.KIND_MS.values() if tag in v)
            assert parts + v[scalars.IDLE_MS] == pytest.approx(v[scalars.STEP_MS], **close)
            assert v[scalars.COMPUTE_MS] == pytest.approx(
                v[scalars.KIND_MS["forward"]] + v[scalars.KIND_MS["backward"]], **close
            )
        _assert_inner_spans_inside_compute(tracks[r], values, category, close)
    aggregate_values = _event_values(os.path.join(log_dir, "aggregate"))
    assert set(aggregate_values) == {*scalars.AGGREGATE_TAGS, kind_ms, scalars.EFFICIENCY}
    assert all(aggregate_values[kind_ms][s] > 0 for s in steps)
    assert _png_size(os.path.join(log_dir, gantt.GANTT_FILE))

    result = summary.load_summary(os.path.join(log_dir, summary.SUMMARY_FILE))
    _assert_category_in_summary(result, category)
    print(f"{case}: ms per step {result['job']['ms_per_step']}")


def _assert_category_in_summary(result: dict, category: str) -> None:
    """`profile.json` and the report: the category's layout entry, its milliseconds per
    step, each rank's calls and bytes (the experts' phases, the gathers' hidden share) and
    the report's column and lines."""
    if category == "gather":
        assert result["layout"]["shard_weights"] is True
    else:
        assert result["layout"][category] == 2
    assert result["layout"]["kind"] == ("tensor" if category == "tensor" else "data")
    for row in [*result["ranks"], result["job"]]:
        ms = row["ms_per_step"]
        assert ms[category] > 0
        assert ms["compute"] + ms[category] <= ms["step"] * (1 + 1e-6)
    for row in result["ranks"]:  # the bytes its collectives moved against their count
        moved = row["collectives"][category]
        assert moved["calls"] > 0 and moved["bytes"] > 0, row
        if category == "experts":
            _assert_expert_phases(moved)
        if category == "gather":  # the transfers' time, and the share of it nobody waited for
            hidden = moved["hidden"]
            assert hidden["ms"] > 0 and 0 <= hidden["share"] <= 1, row
            assert hidden["share"] == pytest.approx(1 - hidden["waited_ms"] / hidden["ms"]), row
    text = report.format_report(result)
    header = next(line.split() for line in text.splitlines() if line.startswith("rank"))
    assert header[header.index("compute") + 1] == category
    assert f"{category.capitalize()} collectives (busiest rank, whole fit):" in text
    if category == "experts":
        assert "dispatch " in text and "; compute " in text and "; combine " in text, text
    if category == "gather":
        assert "of the gather time" in text and "compute hid" in text, text

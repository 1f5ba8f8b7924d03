"""Pipeline schedules as data: completeness, ordering, memory bound and simulated bubble."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyparflow.schedule import (
    Action,
    ActionKind,
    B,
    DeadlockError,
    F,
    ScheduleError,
    W,
    forward_only,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    peak_in_flight,
    simulate,
    theoretical_bubble,
    validate,
    with_transfers,
    zero_bubble,
)

stages = st.integers(min_value=1, max_value=8)
microbatches = st.integers(min_value=1, max_value=16)
names = st.sampled_from(["gpipe", "1f1b"])


def test_action_repr_equality_and_validation():
    assert repr(Action("forward", 3)) == "F3" and repr(Action("backward", 3)) == "B3"
    assert F(2) == Action("forward", 2) and F(2) != B(2)
    assert len({F(1), F(1), B(1)}) == 2
    with pytest.raises(ValueError, match="kind"):
        Action("fwd", 0)
    with pytest.raises(ValueError, match="microbatch"):
        Action("forward", -1)


def test_known_small_schedules():
    assert gpipe(2, 2) == [[F(0), F(1), B(0), B(1)]] * 2
    assert one_f_one_b(3, 4) == [
        [F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)],
        [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)],
        [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)],
    ]
    # Fewer micro-batches than warm-up slots: the warm-up is capped at m.
    assert one_f_one_b(4, 2)[0] == [F(0), F(1), B(0), B(1)]


def test_bad_arguments_name_what_to_change():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'.*1f1b"):
        make_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="num_stages"):
        gpipe(0, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="num_stages"):
        make_schedule("gpipe", True, 2)


@given(names, stages, microbatches)
def test_every_microbatch_forwarded_then_backwarded_once_per_stage(name, p, m):
    schedule = make_schedule(name, p, m)
    assert len(schedule) == p
    for actions in schedule:
        assert sorted(a.microbatch for a in actions if a.is_forward) == list(range(m))
        assert sorted(a.microbatch for a in actions if not a.is_forward) == list(range(m))
        for i in range(m):
            assert actions.index(F(i)) < actions.index(B(i))


@given(names, stages, microbatches)
def test_simulation_respects_dependencies_and_never_deadlocks(name, p, m):
    schedule = make_schedule(name, p, m)
    times = simulate(schedule, comm_time=0.5).times
    for s in range(p):
        for i in range(m):
            if s > 0:
                assert times[s, F(i)][0] >= times[s - 1, F(i)][1] + 0.5
            if s < p - 1:
                assert times[s, B(i)][0] >= times[s + 1, B(i)][1] + 0.5
            assert times[s, B(i)][0] >= times[s, F(i)][1]
        spans = [times[s, a] for a in schedule[s]]
        # consecutive pairs: the shifted copy is one shorter, hence strict=False
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:], strict=False))


@given(stages, microbatches)
def test_1f1b_in_flight_is_min_of_remaining_stages_and_microbatches(p, m):
    for s, actions in enumerate(one_f_one_b(p, m)):
        assert peak_in_flight(actions) == min(p - s, m) <= p


@given(stages, microbatches)
def test_gpipe_keeps_every_microbatch_in_flight(p, m):
    assert all(peak_in_flight(actions) == m for actions in gpipe(p, m))


@given(stages, microbatches, st.sampled_from([0.5, 1.0, 3.0]))
def test_gpipe_bubble_matches_formula_and_1f1b_matches_gpipe(p, m, time):
    bubble = theoretical_bubble(p, m)
    equal = simulate(gpipe(p, m), forward_time=time, backward_time=time)
    assert equal.makespan == pytest.approx(2 * time * (m + p - 1))
    assert equal.bubble == pytest.approx(bubble)
    # 1F1B saves memory, not time: same makespan as GPipe, also with backward = 2 x forward.
    for f, b in [(time, time), (1.0, 2.0)]:
        assert simulate(one_f_one_b(p, m), f, b).makespan == pytest.approx(
            simulate(gpipe(p, m), f, b).makespan
        )


def test_single_stage_has_no_bubble_and_per_stage_times():
    assert simulate(gpipe(1, 4)).bubble == 0.0
    slow_last = simulate(gpipe(2, 1), forward_time=[1.0, 3.0], backward_time=[1.0, 3.0])
    assert slow_last.makespan == 8.0 and slow_last.busy == [2.0, 6.0]
    with pytest.raises(ValueError, match="forward_time has 3 entries"):
        simulate(gpipe(2, 1), forward_time=[1.0, 1.0, 1.0])
    # each stage's setup runs before its first action; a later stage's hides while it waits
    setup = simulate(gpipe(2, 1), 1.0, 1.0, setup_time=[0.5, 1.0])
    assert setup.makespan == 4.5 and setup.busy == [2.0, 2.0]
    late = simulate(gpipe(2, 1), 1.0, 1.0, setup_time=[0.5, 3.0])
    assert late.times[1, F(0)] == (3.0, 4.0) and late.makespan == 6.0
    # the bubble leaves the setups out, as a profiler's step (begun after them) sees it
    assert setup.span == 4.0 and setup.bubble == simulate(gpipe(2, 1), 1.0, 1.0).bubble
    assert late.span == 5.5 and late.bubble == pytest.approx(1 - 4.0 / (2 * 5.5))


def test_forward_only_schedule_simulates():
    sim = simulate(forward_only(3, 4), forward_time=1.0)
    assert sim.makespan == 6.0 and peak_in_flight(forward_only(3, 4)[0]) == 4


def test_deadlocks_are_detected():
    # The last stage lists B0 before the F0 it depends on.
    with pytest.raises(DeadlockError, match="stage 1 waits at B0"):
        simulate([[F(0), B(0)], [B(0), F(0)]])
    # Opposite orders across stages: stage 0 needs B1 from stage 1, which waits for F1 first.
    with pytest.raises(DeadlockError, match="stage 0 waits at B1"):
        simulate([[F(0), B(1), F(1), B(0)], [F(0), F(1), B(0), B(1)]])
    with pytest.raises(DeadlockError, match="waits at F0"):
        simulate([[], [F(0)]])  # depends on an action never scheduled
    with pytest.raises(ValueError, match="twice"):
        simulate([[F(0), F(0)]])


@given(stages, microbatches, names)
def test_transfers_wrap_each_pass_where_a_neighbour_exists(p, m, name):
    """Lowered lists keep the passes in order; each pass is preceded by its receive and followed
    by its send exactly where the stage has that neighbour; simulating them is refused."""
    for stage, actions in enumerate(make_schedule(name, p, m)):
        lowered = with_transfers(actions, stage, p)
        assert [a for a in lowered if a.kind.computes] == actions
        for i, action in enumerate(lowered):
            k = action.microbatch
            if action.kind is ActionKind.FORWARD:
                assert (i > 0 and lowered[i - 1] == Action("recv_activations", k)) == (stage > 0)
                after = i + 1 < len(lowered) and lowered[i + 1] == Action("send_activations", k)
                assert after == (stage < p - 1)
            if action.kind is ActionKind.BACKWARD:
                before = i > 0 and lowered[i - 1] == Action("recv_gradients", k)
                assert before == (stage < p - 1)
                after = i + 1 < len(lowered) and lowered[i + 1] == Action("send_gradients", k)
                assert after == (stage > 0)
        transfers = len(lowered) - len(actions)
        assert transfers == 2 * m * ((stage > 0) + (stage < p - 1))
    if p > 1:
        with pytest.raises(ValueError, match="transfers"):
            simulate([with_transfers(make_schedule(name, p, m)[0], 0, p)] * p)
        with pytest.raises(ValueError, match="transfer already"):
            with_transfers(with_transfers([F(0)], 1, p), 1, p)


@given(names, stages, microbatches)
def test_every_built_schedule_validates_with_and_without_transfers(name, p, m):
    schedule = make_schedule(name, p, m)
    validate(schedule, m)
    validate([with_transfers(actions, s, p) for s, actions in enumerate(schedule)], m)
    validate(forward_only(p, m), m, training=False)
    lowered = [with_transfers(actions, s, p) for s, actions in enumerate(forward_only(p, m))]
    validate(lowered, m, training=False)


def test_the_validator_names_each_kind_of_broken_schedule():
    broken = {
        "misses [B1]": ([[F(0), F(1), B(0)]], 2, True),
        "repeats or adds [F0, F0]": ([[F(0), F(0), B(0)]], 1, True),
        "adds [B0]": ([[F(0), B(0)]], 1, False),  # forward-only steps have no backward
        "runs B0 before F0": ([[B(0), F(0)]], 1, True),
        # each stage complete, but stage 0 waits for B0 of stage 1, which waits for F1 first
        "deadlocks": ([[F(0), B(0), F(1), B(1)], [F(1), F(0), B(0), B(1)]], 2, True),
    }
    for message, (schedule, m, training) in broken.items():
        with pytest.raises(ScheduleError, match=message.replace("[", r"\[").replace("]", r"\]")):
            validate(schedule, m, training=training)


def test_the_validator_refuses_sends_the_neighbour_receives_in_another_order():
    schedule = [with_transfers(actions, s, 2) for s, actions in enumerate(gpipe(2, 2))]
    first = list(schedule[0])
    a, b = first.index(Action("send_activations", 0)), first.index(Action("send_activations", 1))
    first[a], first[b] = first[b], first[a]  # the second stage would take micro-batch 1 for 0
    with pytest.raises(ScheduleError, match=r"sends send_activations of micro-batches \[1, 0\]"):
        validate([first, schedule[1]], 2)
    with pytest.raises(ScheduleError, match="to no stage"):
        validate([with_transfers([F(0), B(0)], 0, 2)], 1)


def _most_held(actions, start, end) -> int:
    """Most micro-batches of one stage past their `start` pass and not yet through `end`:
    the largest count of `start` passes less `end` passes over the list's prefixes."""
    counts = itertools.accumulate((a.kind is start) - (a.kind is end) for a in actions)
    return max(counts, default=0)


@given(stages, microbatches)
def test_zero_bubble_is_1f1b_with_weight_passes_in_its_bubbles(p, m):
    """ZB-H1 (Qi et al. 2024): 1F1B's order of F and B; each stage at most 1F1B's count between
    F and B and the first stage's, p, between F and W; a third of 1F1B's bubble at equal times,
    and never slower."""
    schedule = zero_bubble(p, m)
    validate(schedule, m)
    validate([with_transfers(actions, s, p) for s, actions in enumerate(schedule)], m)
    for s, actions in enumerate(schedule):
        assert [a for a in actions if a.kind is not ActionKind.WEIGHT] == one_f_one_b(p, m)[s]
        assert _most_held(actions, ActionKind.FORWARD, ActionKind.BACKWARD) <= min(p - s, m)
        assert peak_in_flight(actions) == _most_held(actions, ActionKind.FORWARD, ActionKind.WEIGHT)
        assert peak_in_flight(actions) <= min(p, m)
    split = simulate(schedule, forward_time=1.0, backward_time=1.0, weight_time=1.0)
    merged = simulate(one_f_one_b(p, m), forward_time=1.0, backward_time=2.0)
    assert split.makespan <= merged.makespan
    if m >= p:
        assert split.makespan == 3 * m + p - 1  # 1F1B: 3m + 3(p - 1)
        assert merged.makespan == 3 * m + 3 * (p - 1)
    slow_weights = simulate(schedule, forward_time=1.0, backward_time=0.5, weight_time=1.5)
    assert slow_weights.makespan <= merged.makespan


def test_weight_passes_follow_their_backward_and_need_a_time():
    with pytest.raises(ValueError, match="weight_time"):
        simulate(zero_bubble(2, 2))
    times = simulate([[F(0), B(0), W(0)]], 1.0, 1.0, weight_time=3.0).times
    assert times[0, W(0)] == (2.0, 5.0)
    with pytest.raises(ScheduleError, match="runs W0 before B0"):
        validate([[F(0), W(0), B(0)]], 1)
    with pytest.raises(ScheduleError, match=r"misses \[W1\]"):
        validate([[F(0), F(1), B(0), B(1), W(0)]], 2)  # a stage that splits splits every backward
    with pytest.raises(ScheduleError, match="adds"):
        validate([[F(0), W(0)]], 1, training=False)
    assert with_transfers([F(0), B(0), W(0)], 1, 3)[-1] == W(0)  # nothing moves for W


# Interleaved 1F1B: p stages, v model chunks each, m a multiple of p
interleavings = st.tuples(
    st.integers(min_value=1, max_value=6),
    st.integers(min_value=1, max_value=4),
    st.integers(min_value=2, max_value=4),
).map(lambda t: (t[0], t[0] * t[1], t[2]))  # (p, m, v)


@given(interleavings)
def test_interleaved_is_a_valid_step_whose_bubble_is_divided_by_its_chunks(layout):
    """Every (micro-batch, chunk) forwarded and backwarded once per stage, sends matched across
    every link (the last stage's back to the first included), no deadlock; with each chunk
    taking 1/v of a stage's time the simulated idle fraction is (p - 1) / (v m + p - 1)."""
    p, m, v = layout
    schedule = interleaved(p, m, v)
    validate(schedule, m)
    validate([with_transfers(a, s, p, num_chunks=v) for s, a in enumerate(schedule)], m)
    sim = simulate(schedule, forward_time=1.0 / v, backward_time=2.0 / v)
    assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    if p > 1:
        assert sim.bubble < simulate(one_f_one_b(p, m), 1.0, 2.0).bubble
    # Megatron's warm-up: the first stage holds (p - 1) * 2 + (v - 1) * p + 1 chunks' inputs
    assert peak_in_flight(schedule[0]) == min((p - 1) * 2 + (v - 1) * p + 1, m * v)


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved(3, 5, 1) == one_f_one_b(3, 5)
    with pytest.raises(ValueError, match="virtual_stages"):
        interleaved(2, 2, 0)


@given(
    st.integers(min_value=1, max_value=6),
    st.integers(min_value=1, max_value=13),
    st.integers(min_value=2, max_value=4),
)
def test_interleaved_takes_any_count_with_the_padding_left_idle(p, m, v):
    """Micro-batches fewer than the stages or not a multiple of them: the order of the next
    multiple of p without the padding's actions, still a valid step (sends matched, no
    deadlock), and never slower than the padded step."""
    schedule = interleaved(p, m, v)
    validate([with_transfers(a, s, p, num_chunks=v) for s, a in enumerate(schedule)], m)
    padded_count = -(-m // p) * p
    padded = interleaved(p, padded_count, v)
    assert schedule == [[a for a in actions if a.microbatch < m] for actions in padded]
    step = simulate(schedule, forward_time=1.0 / v, backward_time=2.0 / v).makespan
    assert step <= simulate(padded, forward_time=1.0 / v, backward_time=2.0 / v).makespan


def test_the_validator_follows_chunks_across_stages():
    """A chunk's forward missing, a chunk's backward before its forward, and a wrap-around link
    whose sends come in another order than its receives are each refused."""
    schedule = interleaved(2, 2, 2)
    with pytest.raises(ScheduleError, match="misses"):
        validate([schedule[0][1:], schedule[1]], 2)
    swapped = list(schedule[1])
    swapped[2], swapped[3] = swapped[3], swapped[2]  # B0c1 before F0c1 on the last stage
    with pytest.raises(ScheduleError, match="runs B0c1 before F0c1"):
        validate([schedule[0], swapped], 2)
    lowered = [with_transfers(a, s, 2, num_chunks=2) for s, a in enumerate(schedule)]
    last = list(lowered[1])  # its chunk 0 sends activations on to the first stage's chunk 1
    a, b = last.index(Action("send_activations", 0)), last.index(Action("send_activations", 1))
    last[a], last[b] = last[b], last[a]
    with pytest.raises(ScheduleError, match=r"stage 1 sends send_activations of \(micro-batch"):
        validate([lowered[0], last], 2)
    assert repr(F(3, chunk=2)) == "F3c2" and F(3, chunk=0) == F(3)

"""Global batches, replica shards and micro-batches: every sample exactly once per epoch."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyparflow.data import (
    ArraySource,
    check_divisible,
    epoch_order,
    split_bounds,
    split_sizes,
    unpack,
)


@given(st.integers(0, 500), st.integers(1, 17))
def test_split_sizes_are_even_and_complete(total, parts):
    sizes = split_sizes(total, parts)
    assert sum(sizes) == total and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    bounds = [split_bounds(total, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    # consecutive pairs: the shifted copy is one shorter, hence strict=False
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(1, 300),
    batch_per_piece=st.integers(1, 6),
    replicas=st.integers(1, 4),
    microbatches=st.integers(1, 4),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_each_sample_lands_in_exactly_one_microbatch_per_epoch(
    num_samples, batch_per_piece, replicas, microbatches, shuffle, epoch
):
    batch_size = batch_per_piece * replicas * microbatches
    ids = np.arange(num_samples)
    source = ArraySource(ids, ids * 10, batch_size=batch_size, shuffle=shuffle, seed=42)
    seen = []
    for batch in source.epoch(epoch):
        for replica in range(replicas):
            start, stop = split_bounds(batch.size, replicas, replica)
            x, y, _ = batch.part(start, stop)
            np.testing.assert_array_equal(y, x * 10)  # targets travel with their inputs
            count = min(microbatches, stop - start)
            for k in range(count):
                a, b = split_bounds(stop - start, count, k)
                assert b > a  # no empty micro-batch
                seen.extend(x[a:b].tolist())
    assert sorted(seen) == ids.tolist()
    assert len(source) == -(-num_samples // batch_size)


def test_shuffled_order_is_shared_and_changes_per_epoch():
    first = epoch_order(100, True, seed=7, epoch=0)
    assert np.array_equal(first, epoch_order(100, True, seed=7, epoch=0))  # every rank agrees
    assert not np.array_equal(first, epoch_order(100, True, seed=7, epoch=1))
    assert np.array_equal(epoch_order(5, False, seed=7, epoch=3), np.arange(5))


def test_batch_must_split_into_replicas_and_microbatches():
    check_divisible(16, 2, 4)
    with pytest.raises(ValueError, match="use a multiple of 8"):
        check_divisible(12, 2, 4)


def test_inputs_of_different_lengths_are_rejected():
    with pytest.raises(ValueError, match="same number of samples"):
        ArraySource(np.zeros((5, 2)), np.zeros(4))
    with pytest.raises(ValueError, match="empty"):
        ArraySource(np.zeros((0, 2)), np.zeros(0))


def test_unpack_follows_keras_conventions():
    assert unpack((1,)) == (1, None, None)
    assert unpack((1, 2)) == (1, 2, None)
    assert unpack((1, 2, 3)) == (1, 2, 3)
    assert unpack({"a": 1}) == ({"a": 1}, None, None)
    with pytest.raises(ValueError, match="sample_weight"):
        unpack((1, 2, 3, 4))


def _keras_epochs(x, batch_size, steps, epochs):
    """The first sample of each batch Keras's own EpochIterator gives, epoch by epoch."""
    import warnings

    from keras.src.trainers.epoch_iterator import EpochIterator

    iterator = EpochIterator(x, batch_size=batch_size, steps_per_epoch=steps)
    iterator.reset()
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(epochs):
            firsts = []
            with iterator.catch_stop_iteration():
                for _, _, buffer in iterator:
                    firsts.extend(int(np.asarray(b[0]).ravel()[0]) for b in buffer)
            seen.append(firsts)
    return seen


def _hyparflow_epochs(source, steps, epochs):
    import warnings

    from hyparflow.data.steps import EpochSteps

    stepped = EpochSteps(source, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [
            [int(np.asarray(b.part(0, b.size)[0]).ravel()[0]) for b in stepped.epoch(e)]
            for e in range(epochs)
        ]


@pytest.mark.parametrize("samples", [40, 44, 64])
@pytest.mark.parametrize("steps", [None, 1, 3, 4, 5, 7])
def test_steps_per_epoch_cuts_epochs_as_keras_does(samples, steps):
    """Keras 3 goes on from where the last epoch stopped and ends an epoch early where the data
    runs out; checked against Keras's own EpochIterator, for arrays and for a generator."""
    from hyparflow.data import make_source

    x = np.arange(samples)
    want = _keras_epochs(x, 8, steps, epochs=4)
    assert _hyparflow_epochs(make_source(x, batch_size=8), steps, 4) == want

    def generator():
        for start in range(0, samples, 8):
            yield (x[start : start + 8],)

    if steps is not None:  # a generator without steps_per_epoch is one epoch's data (below)
        want = _keras_epochs(generator(), None, steps, epochs=4)
        assert _hyparflow_epochs(make_source(generator()), steps, 4) == want


def test_the_data_digest_sees_a_shuffle_and_groups_the_ranks():
    from hyparflow.data.fingerprint import array_digest, differing_ranks, mismatch_message

    x = np.random.default_rng(0).normal(size=(1000, 3)).astype("float32")
    y = np.arange(1000)
    same = array_digest((x, y, None))
    assert array_digest((x.copy(), y.copy(), None)) == same
    shuffled = np.random.default_rng(1).permutation(1000)
    assert array_digest((x[shuffled], y[shuffled], None)) != same  # rows 0 and 999 moved
    assert array_digest((x, y, np.ones(1000))) != same
    assert array_digest((x.astype("float64"), y, None)) != same
    assert differing_ranks(["a", "b", "a", "a"]) == [[0, 2, 3], [1]]
    assert differing_ranks(["a", "a"]) == [[0, 1]]
    assert "differs across ranks: ranks [0, 2, 3] vs [1]." in mismatch_message([[0, 2, 3], [1]])

"""A stage run as a chain of segments, so that the gradients of its last layers are final, and
their reduction across replicas can start, while earlier layers are still in backward.

This is the bucketed overlap of PyTorch DDP (Li et al., VLDB 2020) applied per pipeline stage:
the stage's sub-graph is cut into contiguous segments with the partitioner, each segment runs
as its own `StageRunner`, and during the last micro-batch's backward each finished segment
hands its variables' summed gradients to the reducer.
"""

from __future__ import annotations

from functools import partial

import tensorflow as tf

from hyparflow.engine.gradients import sparse as row_sparse


class SegmentedRunner:
    """A `Runner` (engine/stages/runner.py) over a chain of segment `StageRunner`s (same results,
    finer steps).

    `variables` is the stage's variable list; `take_gradients` returns their gradients in that
    order, summing the parts of a variable used by several segments. `sparse`: the positions
    of its embedding tables, whose row slices stay in the runners of the segments that hold
    them (concatenated over micro-batches there) until `take_tables` joins them (`per_batch`:
    a table's rows come once per batch, and are added); `collect` and `take` move the other
    variables' sums.
    """

    updates_metrics = False  # the trainer updates metrics from the outputs
    layout = None  # gradients stay a list
    flat_backward = False  # nothing to pack before the first forward
    slice_gradients = False  # each variable's gradient, whole

    def __init__(self, segments: list, variables: list, sparse=(), per_batch=None):
        self.segments = segments
        self.variables = list(variables)
        self.sparse = sorted(sparse)
        self._per_batch = per_batch or [False] * len(self.sparse)
        self.is_last = segments[-1].is_last
        self.last_added = None
        self._accumulated: dict[int, object] = {}

    def forward(self, microbatch: int, inputs, targets=None, scale=1.0, rows=None):
        for segment in self.segments:  # a kept tape is not held through the others' forwards
            segment.drop_kept_forwards()
        for j, segment in enumerate(self.segments[:-1]):
            self._gather_next_after(j, self.segments[j + 1].prefetch)
            inputs = segment.forward(microbatch, inputs, scale=scale, rows=rows)
        outputs = self.segments[-1].forward(microbatch, inputs, targets, scale, rows)
        self.last_added = tf.add_n([s.last_added for s in self.segments])
        return outputs

    def _gather_next_after(self, j: int, start, backward_of=None) -> None:
        """ZeRO-3's prefetch (FSDP's): `start()` the next segment's weight gather once segment
        j has read its own out, so that it runs while segment j computes, and a rank holds
        one segment's gathered weights and the next one's transfer, not three; at once where
        segment j gathers nothing in this call (the backward of micro-batch `backward_of`
        that differentiates its kept forward)."""
        gathers = (
            self.segments[j].gathers
            if backward_of is None
            else self.segments[j].gathers_in_backward(backward_of)
        )
        if gathers:
            self.segments[j].after_gather(start)
        else:
            start()

    @property
    def has_added_losses(self) -> bool:
        return any(s.has_added_losses for s in self.segments)

    def prepare(self) -> None:
        """Nothing to pack: the segments read their variables themselves."""

    def weight(self, microbatch: int) -> None:
        """Nothing: each segment's backward computes its weight gradients too."""

    def backward(self, microbatch: int, output_grads=None, on_segment_done=None):
        """Backward through the segments, last first; `on_segment_done(j)` after segment j."""
        grads = output_grads
        for j in reversed(range(len(self.segments))):
            if j:
                earlier = partial(self.segments[j - 1].prefetch_backward, microbatch)
                self._gather_next_after(j, earlier, microbatch)
            grads = self.segments[j].backward(microbatch, grads)
            if on_segment_done is not None:
                on_segment_done(j)
            if j:  # the previous segment wants gradients of its float outputs only
                grads = [g for g in grads if g is not None]
        return grads

    def infer(self, inputs):
        for j, segment in enumerate(self.segments[:-1]):
            self._gather_next_after(j, self.segments[j + 1].prefetch)
            inputs = segment.infer(inputs)
        outputs = self.segments[-1].infer(inputs)
        self.last_added = tf.add_n([s.last_added for s in self.segments])
        return outputs

    def collect(self, j: int) -> None:
        """Move segment j's summed gradients (but the tables') into the per-variable totals."""
        segment = self.segments[j]
        dense = [segment.variables[i] for i in segment.dense]
        for variable, grad in zip(dense, segment.take_dense_gradients(), strict=True):
            key = id(variable)
            self._accumulated[key] = (
                grad if key not in self._accumulated else (self._accumulated[key] + grad)
            )

    def total(self, variable):
        """The summed gradient of `variable` collected so far (zeros if none)."""
        grad = self._accumulated.get(id(variable))
        return tf.zeros(variable.shape, variable.dtype) if grad is None else grad

    def take(self, variable):
        """The summed gradient of `variable` collected so far (zeros if none), let go here."""
        grad = self._accumulated.pop(id(variable), None)
        return tf.zeros(variable.shape, variable.dtype) if grad is None else grad

    def take_tables(self) -> list:
        """The tables' row slices since the last call, in `sparse` order (no rows where no
        micro-batch read one)."""
        found: dict[int, list] = {}
        for segment in self.segments:
            tables = [segment.variables[i] for i in segment.sparse]
            for table, rows in zip(tables, segment.take_sparse_gradients(), strict=True):
                if not _reads_none(rows):  # a segment holding the table without looking it up
                    found.setdefault(id(table), []).append(rows)
        tables = [self.variables[i] for i in self.sparse]
        return [
            row_sparse.concat_rows(found.get(id(table), []), table, per_batch)
            for table, per_batch in zip(tables, self._per_batch, strict=True)
        ]

    def take_gradients(self) -> list:
        for j in range(len(self.segments)):
            self.collect(j)
        grads = [self.total(v) for v in self.variables]
        for i, table in zip(self.sparse, self.take_tables(), strict=True):
            grads[i] = table
        self._accumulated = {}
        return grads

    def reset(self) -> None:
        """Forget collected totals (after they were handed to the reducer)."""
        self._accumulated = {}


def _reads_none(rows) -> bool:
    """Whether a table's gradient is row slices of no row."""
    return isinstance(rows, tf.IndexedSlices) and rows.indices.shape[0] == 0

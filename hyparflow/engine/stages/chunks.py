"""A pipeline rank's model chunks (interleaved schedules): one runner per chunk, one gradient set.

Under interleaved 1F1B (Narayanan et al. 2021, SC'21) a rank runs several non-adjacent stages
of the model. The walk drives each chunk's own `StageRunner` (`runners`); the reduction sees
one runner whose variables are every chunk's, each once, and whose gradients are the chunks'
summed: a variable two chunks share (a layer called in both) gets both contributions, as it
would in one stage.
"""

from __future__ import annotations

import tensorflow as tf

from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.traced import traced


class ChunkRunners:
    """The gradient side of a rank's chunk runners (`runners`, in model order), over the
    rank's `variables` (each chunk's variables are among them), `sparse` the positions of
    embedding tables. `layout`: the `FlatLayout` of the dense variables when they are reduced
    as one flat tensor, else None (the chunks themselves always keep lists)."""

    flat_backward = False  # each chunk packs nothing: its gradients come as a list
    slice_gradients = False  # each variable's gradient, whole

    def __init__(self, runners, variables, sparse, layout=None):
        self.runners = list(runners)
        self.variables = list(variables)
        self.sparse = sorted(sparse)
        self.dense = sorted(set(range(len(self.variables))) - set(self.sparse))
        self.layout = layout
        where = {id(v): i for i, v in enumerate(self.variables)}
        self._positions = [[where[id(v)] for v in r.variables] for r in self.runners]
        self._tables = None  # tables' gradients taken with the dense ones, not yet handed over
        if layout is not None:
            self._flatten_fn = traced(lambda grads: layout.flatten(grads, 0.0))

    @property
    def has_added_losses(self) -> bool:
        return any(r.has_added_losses for r in self.runners)

    def take_gradients(self) -> list:
        """Every chunk's summed gradients, added where chunks share a variable (tables' row
        slices concatenated)."""
        totals: list = [[] for _ in self.variables]
        for runner, positions in zip(self.runners, self._positions, strict=True):
            for i, grad in zip(positions, runner.take_gradients(), strict=True):
                totals[i].append(grad)
        return [_sum(grads, self.variables[i], i in self.sparse) for i, grads in enumerate(totals)]

    def take_flat_gradients(self):
        """The dense gradients as the layout's flat tensor; the tables' wait for
        `take_sparse_gradients`."""
        grads = self.take_gradients()
        self._tables = [grads[i] for i in self.sparse]
        return self._flatten_fn([grads[i] for i in self.dense])

    def take_sparse_gradients(self) -> list:
        """The tables' gradients, taken with the last `take_flat_gradients`."""
        tables, self._tables = self._tables, None
        if tables is None:
            raise RuntimeError("take_flat_gradients first: it takes every chunk's gradients")
        return tables


def _sum(grads: list, variable, table: bool):
    if table:
        return row_sparse.concat_rows(grads, variable)
    return grads[0] if len(grads) == 1 else tf.add_n([tf.convert_to_tensor(g) for g in grads])

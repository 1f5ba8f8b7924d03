"""Forward, loss and gradients of an unpartitioned model in one compiled call.

When the whole model is the only stage (data parallelism, or one rank), nothing has to live
between a micro-batch's forward and its backward, so both run in one traced function, as in
Keras's own train step. Differentiating inside the trace matters for speed: a function called
under an eager tape must export its intermediate tensors for the backward, which keeps Grappler
from fusing kernels such as oneDNN's MatMul+BiasAdd+ReLU (docs/engine.md).
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from hyparflow.engine import sparse as rows
from hyparflow.engine.random_slices import slice_of


class FusedRunner:
    """`StageRunner`'s interface for a model that is the only stage of its pipeline.

    `forward` computes the outputs, the loss and the micro-batch's gradients at once and adds
    them to the step's total; `backward` has nothing left to do. `call(inputs, training)`,
    `variables` and `loss(y, y_pred, sample_weight)` mean what they mean for `StageRunner`;
    `metrics(y, y_pred, sample_weight)`, if given, updates the compiled metrics in the same
    call (`updates_metrics` tells the caller not to). With a `layout` (`FlatLayout` of the
    dense variables, or `ChunkedLayout`), their gradients are kept as one flat tensor (or a
    tuple of chunks: `take_flat_gradients`).

    `sparse`: positions of embedding tables, whose gradients stay row slices: each
    micro-batch's are kept as they come and concatenated in order (`take_sparse_gradients`).
    `added_losses()` (`last_added`, `has_added_losses`), `relax_shapes` and `train_scope` mean
    what they mean for `StageRunner`.

    `microbatches`: how many micro-batches a step has. With more than one, every micro-batch,
    the first included, adds its gradients to a total (zeros at first), so one function is
    traced instead of a first-micro-batch function and an accumulating one.

    For example:
        runner = FusedRunner(lambda x, training: model(x, training=training),
                             model.trainable_variables, loss=_keras.compiled_loss(model))
        runner.forward(0, x, targets=(y, None), scale=1.0); runner.backward(0)
        grads = runner.take_gradients()
    """

    def __init__(
        self,
        call,
        variables,
        loss,
        metrics=None,
        layout=None,
        sparse=(),
        added_losses=None,
        relax_shapes=False,
        train_scope=None,
        microbatches=1,
    ):
        self.variables = list(variables)
        self.layout = layout
        self.sparse = sorted(sparse)
        self.dense = sorted(set(range(len(self.variables))) - set(self.sparse))
        self._sparse_pieces: list[list] = []  # per micro-batch, the row-sparse gradients
        self._added_losses = added_losses
        self._train_scope = train_scope or contextlib.nullcontext
        self.has_added_losses = False
        self.last_added = None
        self._metrics = metrics
        self.updates_metrics = metrics is not None
        self._sources = [getattr(v, "value", v) for v in self.variables]
        self._call = call
        self._loss = loss
        self._grads = None
        self._forwarded: set[int] = set()
        self._sums_from_zeros = microbatches > 1
        self._first_fn = tf.function(self._first_body, reduce_retracing=relax_shapes)
        self._accumulate_fn = tf.function(self._accumulate_body, reduce_retracing=relax_shapes)
        self._infer_fn = tf.function(self._infer_body, reduce_retracing=relax_shapes)

    def _gradients(self, inputs, y, sample_weight, scale, piece):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(self._sources)
            # dropout: this piece's rows of the global batch's masks
            with slice_of(piece), self._train_scope():
                y_pred = self._call(inputs, True)
            added = self._added()
            loss = self._loss(y, y_pred, sample_weight)
            scaled = (loss + added) * scale
        if self._metrics is not None:
            self._metrics(y, y_pred, sample_weight)
        grads = tape.gradient(
            scaled, self._sources, unconnected_gradients=tf.UnconnectedGradients.NONE
        )
        rows.check_kinds(grads, self.sparse, self.variables)
        # a table the loss does not read contributes no rows (zeros would be dense)
        sparse = [rows.or_empty(grads[i], self.variables[i]) for i in self.sparse]
        dense = [
            tf.zeros_like(self._sources[i]) if grads[i] is None else tf.convert_to_tensor(grads[i])
            for i in self.dense
        ]
        if self.layout is not None:
            return y_pred, loss, added, self.layout.flatten(dense, scaled), sparse
        return y_pred, loss, added, dense, sparse

    def _added(self):
        added = self._added_losses() if self._added_losses is not None else None
        if added is None:
            return tf.zeros((), tf.float32)
        self.has_added_losses = True
        return added

    def _first_body(self, inputs, y, sample_weight, scale, piece):
        return self._gradients(inputs, y, sample_weight, scale, piece)

    def _accumulate_body(self, inputs, y, sample_weight, scale, piece, totals):
        y_pred, loss, added, grads, sparse = self._gradients(inputs, y, sample_weight, scale, piece)
        if self.layout is not None:  # one flat tensor, or a tuple of chunks
            return y_pred, loss, added, tf.nest.map_structure(tf.add, totals, grads), sparse
        return y_pred, loss, added, [t + g for t, g in zip(totals, grads, strict=True)], sparse

    def _infer_body(self, inputs):
        outputs = self._call(inputs, False)
        return outputs, self._added()

    def forward(self, microbatch: int, inputs, targets=None, scale=1.0, piece=None):
        """Outputs and loss of `microbatch` as `(y_pred, loss)`; its gradient, weighted by
        `scale`, is added to the step's total. `piece` means what it means for `StageRunner`."""
        y, sample_weight = targets
        scale = tf.constant(scale, tf.float32)
        piece = None if piece is None else tf.constant(piece, tf.int32)
        if self._grads is None and self._sums_from_zeros:
            self._grads = self._zero_totals()
        if self._grads is None:
            y_pred, loss, self.last_added, self._grads, sparse = self._first_fn(
                inputs, y, sample_weight, scale, piece
            )
        else:
            y_pred, loss, self.last_added, self._grads, sparse = self._accumulate_fn(
                inputs, y, sample_weight, scale, piece, self._grads
            )
        self._sparse_pieces.append(sparse)
        self._forwarded.add(microbatch)
        return y_pred, loss

    def _zero_totals(self):
        if self.layout is not None:
            return self.layout.zeros()
        return [tf.zeros_like(self._sources[i]) for i in self.dense]

    def backward(self, microbatch: int, output_grads=None) -> list:
        """Nothing to compute (the forward took the gradients); no inputs need gradients."""
        self._forwarded.discard(microbatch)
        return []

    def infer(self, inputs):
        """Forward without gradients, in inference mode (validation, evaluate, predict)."""
        outputs, self.last_added = self._infer_fn(inputs)
        return outputs

    def take_gradients(self) -> list:
        """Summed variable gradients of the micro-batches since the last call (zeros if none);
        row slices concatenated for the embedding tables."""
        if self.layout is not None:
            dense = self.layout.unflatten_fn(self.take_flat_gradients())
        else:
            dense, self._grads = self._grads, None
            if dense is None:
                dense = [tf.zeros_like(self.variables[i]) for i in self.dense]
        tables = self.take_sparse_gradients()
        return rows.in_order(len(self.variables), self.dense, dense, self.sparse, tables)

    def take_flat_gradients(self):
        """The dense variables' summed gradients as the layout's one flat tensor (needs a
        `layout`); take the tables' with `take_sparse_gradients`."""
        flat, self._grads = self._grads, None
        return self.layout.zeros() if flat is None else flat

    def take_sparse_gradients(self) -> list:
        """The embedding tables' gradients since the last call, in `sparse` order."""
        pieces, self._sparse_pieces = self._sparse_pieces, []
        return rows.concat_pieces(pieces, self.sparse, self.variables)

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose (empty) backward has not been called yet."""
        return len(self._forwarded)

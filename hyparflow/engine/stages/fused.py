"""Forward, loss and gradients of an unpartitioned model in one compiled call.

When the whole model is the only stage (data parallelism, or one rank), nothing has to live
between a micro-batch's forward and its backward, so both run in one traced function, as in
Keras's own train step. Differentiating inside the trace matters for speed: a function called
under an eager tape must export its intermediate tensors for the backward, which keeps Grappler
from fusing kernels such as oneDNN's MatMul+BiasAdd+ReLU (docs/engine.md).
"""

from __future__ import annotations

import tensorflow as tf

from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.engine.keras_semantics.random_slices import slice_of
from hyparflow.engine.stages.runner import RunnerBase
from hyparflow.traced import traced


class FusedRunner(RunnerBase):
    """A `Runner` (engine/stages/runner.py) for a model that is the only stage of its pipeline.

    `forward` computes the outputs, the loss and the micro-batch's gradients at once and adds
    them to the step's total; `backward` has nothing left to do. `call(inputs, training)`,
    `variables` and `loss(y, y_pred, sample_weight)` mean what they mean for `StageRunner`;
    `metrics(y, y_pred, sample_weight)`, if given, updates the compiled metrics in the same
    call (`updates_metrics` tells the caller not to). With a `layout` (`FlatLayout` of the
    dense variables, or `BucketedLayout`), their gradients are kept as one flat tensor (or a
    tuple of buckets: `take_flat_gradients`).

    `sparse`, `added_losses`, `train_scope` and `input_shapes` are `RunnerBase`'s options.

    `microbatches`: how many micro-batches a step has. With more than one, every micro-batch,
    the first included, adds its gradients to a total (zeros at first), so one function is
    traced instead of a first-micro-batch function and an accumulating one.

    For example, a step of two micro-batches (halves of the batch):
        runner = FusedRunner(lambda x, training: model(x, training=training),
                             model.trainable_variables, loss=_keras.compiled_loss(model),
                             microbatches=2)
        for k, (x, y) in enumerate(halves):
            runner.forward(k, x, targets=(y, None), scale=0.5)
        grads = runner.take_gradients()  # their sum: no backward call was needed
    """

    def __init__(self, call, variables, loss, metrics=None, layout=None, microbatches=1, **common):
        super().__init__(call, variables, **common)  # RunnerBase's options
        self.layout = layout
        self.flat_backward = False  # the compiled call reads the variables themselves
        self._metrics = metrics
        self.updates_metrics = metrics is not None
        self._loss = loss
        self._forwarded: set[int] = set()
        self._sums_from_zeros = microbatches > 1
        self._first_fn = traced(self._first_body, reduce_retracing=True)
        self._accumulate_fn = traced(self._accumulate_body, reduce_retracing=True)

    def _gradients(self, inputs, y, sample_weight, scale, rows):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(self._sources)
            # dropout: this micro-batch's rows of the global batch's masks
            with slice_of(rows), self._train_scope():
                y_pred = self._call(inputs, True)
            added = self._added()
            loss = self._loss(y, y_pred, sample_weight)
            scaled = (loss + added) * scale
        if self._metrics is not None:
            self._metrics(y, y_pred, sample_weight)
        grads = tape.gradient(
            scaled, self._sources, unconnected_gradients=tf.UnconnectedGradients.NONE
        )
        row_sparse.check_kinds(grads, self.sparse, self.variables)
        # a table the loss does not read contributes no rows (zeros would be dense)
        sparse = [row_sparse.or_empty(grads[i], self.variables[i]) for i in self.sparse]
        dense = [
            tf.zeros_like(self._sources[i]) if grads[i] is None else tf.convert_to_tensor(grads[i])
            for i in self.dense
        ]
        if self.layout is not None:
            return y_pred, loss, added, self.layout.flatten(dense, scaled), sparse
        return y_pred, loss, added, dense, sparse

    def _first_body(self, inputs, y, sample_weight, scale, rows):
        return self._gradients(inputs, y, sample_weight, scale, rows)

    def _accumulate_body(self, inputs, y, sample_weight, scale, rows, totals):
        y_pred, loss, added, grads, sparse = self._gradients(inputs, y, sample_weight, scale, rows)
        if self.layout is not None:  # one flat tensor, or a tuple of buckets
            return y_pred, loss, added, tf.nest.map_structure(tf.add, totals, grads), sparse
        return y_pred, loss, added, [t + g for t, g in zip(totals, grads, strict=True)], sparse

    def forward(self, microbatch: int, inputs, targets=None, scale=1.0, rows=None):
        """Outputs and loss of `microbatch` as `(y_pred, loss)`; its gradient, weighted by
        `scale`, is added to the step's total. `rows` means what it means for `StageRunner`."""
        y, sample_weight = targets
        scale = tf.constant(scale, tf.float32)
        rows = None if rows is None else tf.constant(rows, tf.int32)
        if self._grads is None and self._sums_from_zeros:
            self._grads = self._zero_totals()
        if self._grads is None:
            args = (inputs, y, sample_weight, scale, rows)
            function = self._relaxed(self._first_fn, args, targets=(1, 2))
        else:
            args = (inputs, y, sample_weight, scale, rows, self._grads)
            function = self._relaxed(self._accumulate_fn, args, targets=(1, 2))
        y_pred, loss, self.last_added, self._grads, sparse = function(*args)
        self._sparse_per_microbatch.append(sparse)
        self._forwarded.add(microbatch)
        return y_pred, loss

    def _zero_totals(self):
        return self.layout.zeros() if self.layout is not None else self._zero_dense()

    def backward(self, microbatch: int, output_grads=None) -> list:
        """Nothing to compute (the forward took the gradients); no inputs need gradients."""
        self._forwarded.discard(microbatch)
        return []

    def prepare(self) -> None:
        """Nothing to pack: the compiled call reads the variables themselves."""

    @property
    def _totals_are_flat(self) -> bool:
        return self.layout is not None

    def take_flat_gradients(self):
        """The dense variables' summed gradients as the layout's one flat tensor (needs a
        `layout`); take the tables' with `take_sparse_gradients`."""
        flat, self._grads = self._grads, None
        return self.layout.zeros() if flat is None else flat

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose (empty) backward has not been called yet."""
        return len(self._forwarded)

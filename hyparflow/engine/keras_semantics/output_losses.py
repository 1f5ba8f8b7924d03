"""Per-output loss means of a multi-output model, weighted as Keras's own `fit` weights them."""

from __future__ import annotations

import tensorflow as tf
from keras import tree

from hyparflow import _keras
from hyparflow.engine.keras_semantics.metrics import build_outside_the_trace
from hyparflow.intercept import Replaced


class OutputLosses:
    """The compiled loss, with its per-output loss means (`<output>_loss` in History) weighted
    per piece of a global batch so that, summed over pieces and replicas, they hold Keras's.

    Keras's compiled loss (`CompileLoss.call`) updates one `keras.metrics.Mean` per output
    with the batch's mean loss, weighted by the batch's *static* size: under the compiled
    `fit`, `evaluate` and validation the batch size is unknown (None), so every batch counts
    once, a smaller last batch as much as a full one; under `run_eagerly=True` it counts by its
    rows. hyparflow computes each batch's loss in pieces (replicas, micro-batches) whose static
    size depends on tracing, so it weights each piece itself: its rows over the global batch's
    rows (compiled) or its rows (eager). The total loss is tracked apart (trainer._track_loss).

    This reaches into Keras's private `CompileLoss` (`_keras.output_loss_means`, made by its
    `build()`, which the first call runs eagerly so that the trace creates no variable and is
    not traced again) and the `update_state` call it makes on each Mean. The weight is put in
    for the length of one call only, so the model's own `fit` is left as it was.

    For example:
        losses = OutputLosses(model)
        losses.begin(global_batch_size)       # eagerly, before each step
        loss = losses(y, y_pred, sample_weight)  # inside the traced loss forward
    """

    def __init__(self, model) -> None:
        self.model = model
        with tf.init_scope():  # the global batch's rows, read by the traced calls
            self._rows = tf.Variable(1.0, trainable=False, dtype=tf.float32)
        self._size = 1

    def begin(self, global_size: int) -> None:
        """Say the size of the global batch whose pieces the next calls compute."""
        if global_size != self._size:  # (assigned only when it changes: the last batch)
            self._rows.assign(float(global_size))
            self._size = global_size

    def __call__(self, y, y_pred, sample_weight):
        compile_loss = _keras.compiled_loss(self.model)
        if not compile_loss.built:  # its per-output Means: not variables of the trace
            build_outside_the_trace(compile_loss, y, y_pred)
        rows = tf.cast(tf.shape(tree.flatten(y_pred)[0])[0], tf.float32)
        weight = rows if self.model.run_eagerly else rows / self._rows
        with _weighted(compile_loss, weight):
            return compile_loss(y, y_pred, sample_weight)


def _weighted(compile_loss, weight) -> Replaced:
    """For the length of one call of `compile_loss` (built): its per-output Means take `weight`
    as the sample weight of each update."""

    def weigh(update):
        return lambda values, sample_weight=None: update(values, sample_weight=weight)

    means = _keras.output_loss_means(compile_loss)
    return Replaced((metric, "update_state", weigh) for metric in means)

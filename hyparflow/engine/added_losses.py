"""Losses a model's layers add while they run (`add_loss`, activity regularizers), as Keras sums
them into the training loss.

Keras's `compute_loss` adds every such loss, summed, to the compiled loss of the batch. Across
micro-batches and replicas each piece's added loss is weighted by its share of the global batch,
like its compiled loss: exact for losses that are batch means, as Keras's activity regularizers
are (it divides them by the batch size) and as `add_loss` values usually are; a loss that is a
batch sum would count its pieces too little (docs/engine.md, "Added losses").
"""

from __future__ import annotations

import tensorflow as tf
from keras import backend, ops


def added_loss(layers):
    """The sum of the losses `layers` added during the call just made, or None if none did.

    Call it inside the same trace (and stateless scope, if any) as the call.
    """
    losses = [loss for layer in layers for loss in layer._get_own_losses()]
    if not losses:
        return None
    total = None
    for loss in losses:  # as Keras's Trainer._aggregate_additional_loss
        if not backend.is_float_dtype(loss.dtype):
            loss = ops.cast(loss, backend.floatx())
        loss = tf.cast(ops.sum(loss), tf.float32)
        total = loss if total is None else total + loss
    return total

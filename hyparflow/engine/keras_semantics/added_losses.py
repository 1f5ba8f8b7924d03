"""Losses a model's layers add while they run (`add_loss`, activity regularizers), as Keras sums
them into the training loss.

Keras's `compute_loss` adds every such loss, summed, to the compiled loss of the batch. Across
micro-batches and replicas each piece's added loss is weighted by its share of the global batch,
like its compiled loss: exact for losses that are batch means, as Keras's activity regularizers
are (it divides them by the batch size) and as `add_loss` values usually are; a loss that is a
batch sum would count its pieces too little (docs/engine.md, "Added losses").
"""

from __future__ import annotations

import warnings

import tensorflow as tf
from keras import backend, ops

from hyparflow import _keras


def added_loss(layers, adders: set | None = None):
    """The sum of the losses `layers` added during the call just made, or None if none did;
    the names of layers that added one through `add_loss` itself (not as an activity
    regularizer) go into `adders`.

    Call it inside the same trace (and stateless scope, if any) as the call.
    """
    losses = []
    for layer in layers:
        own = _keras.own_losses(layer)
        losses.extend(own)
        if own and adders is not None and getattr(layer, "activity_regularizer", None) is None:
            adders.add(layer.name)
    if not losses:
        return None
    total = None
    for loss in losses:  # as Keras's Trainer._aggregate_additional_loss
        if not backend.is_float_dtype(loss.dtype):
            loss = ops.cast(loss, backend.floatx())
        loss = tf.cast(ops.sum(loss), tf.float32)
        total = loss if total is None else total + loss
    return total


def refuse_unless_batch_means(adders: set, pieces: int, comm) -> None:
    """With `Strategy(strict_added_losses=True)`: raise on every rank of `comm` (collective)
    if any rank's layers add losses with add_loss while the batch runs in pieces."""
    found = sorted(set().union(*comm.allgather(sorted(adders))))
    if not found or pieces == 1:
        return
    raise ValueError(
        f"Layers {found[:5]} add losses with add_loss, and with the global batch cut into "
        f"{pieces} pieces (replicas x micro-batches) hyparflow can only weight each piece's "
        "value by its share of the batch, which equals Keras's value for batch means alone "
        "(strict_added_losses=True refuses them; training stopped after its first step). "
        "Use one replica and num_microbatches=1, build the loss from hf.global_mean, or pass "
        "strict_added_losses=False to train with the warning (docs/models.md, 'Added losses')."
    )


def warn_unless_batch_means(adders: set, pieces: int) -> None:
    """Say, once, that `add_loss` values are taken as batch means when a batch runs in pieces."""
    if not adders or pieces == 1:
        return
    warnings.warn(
        f"Layers {sorted(adders)} add losses with add_loss. With the global batch cut into "
        f"{pieces} pieces (replicas x micro-batches), hyparflow weights each piece's value by "
        "its share of the batch, which equals Keras's value only for losses that are batch "
        "means; a loss that is not (a sum over the batch, or a product of batch means such as "
        "a mixture-of-experts load-balancing loss) trains differently. Use one replica and "
        "num_microbatches=1 for such a model (docs/models.md, 'Added losses').",
        stacklevel=2,
    )

"""The router's load-balancing loss of the whole global batch, computed by each piece of it.

keras_hub's mixtures (Switch Transformer's loss, Fedus et al. 2021) add
`E * sum_e f_e * P_e`: `f_e` the share of (unmasked) tokens whose top-k picks include expert
`e`, averaged over the k picks, and `P_e` their mean router probability for `e`, both means
over the batch. A replica computing both on its own rows gets another product. But `f` and the
token count carry no gradient, and given them the loss is linear in each piece's probability
sums `S_e`: `L = E * sum_e f_e * (sum_pieces S_e) / N`. So each piece sums its counts, tokens
and rows with the others' (`global_sum`, one allreduce in the step, as synchronised
BatchNormalization sums its moments) and returns the loss whose share-weighted sum over the
pieces, as the engine weights added losses (rows / global rows), is `L`, in value and gradient.
In one process (`global_sum` None) it is keras_hub's own formula. A micro-batch cannot do this
in its forward: its loss needs the counts of those not yet run, so micro-batches record
`routing_sums` instead and take their gradient once all have run (`router_tally.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf


def _token_mask(mask, tokens: int):
    """(tokens,) float32: 1 for a token the loss counts. A (batch, seq) padding mask as Mixtral
    gets it, or a (batch, seq, seq) attention mask as Qwen3-MoE does (a token attending to
    anything counts)."""
    if mask is None:
        return tf.ones([tokens], tf.float32)
    mask = tf.cast(mask, tf.bool)
    if mask.shape.rank == 3:
        mask = tf.reduce_any(mask, axis=-1)
    return tf.reshape(tf.cast(mask, tf.float32), [-1])


def routing_sums(logits, top_k: int, mask=None):
    """What the load-balancing loss needs of these tokens' router `logits` (tokens, experts):
    each expert's picks (no gradient), the tokens counted (no gradient) and each expert's sum of
    router probabilities over them (`S_e`, differentiable)."""
    experts = logits.shape[-1]
    probs = tf.nn.softmax(tf.cast(logits, tf.float32), axis=-1)
    _, picks = tf.math.top_k(probs, k=top_k)
    counted = _token_mask(mask, tf.shape(probs)[0])
    picked = tf.reduce_sum(tf.one_hot(picks, experts) * counted[:, None, None], axis=[0, 1])
    probability_sums = tf.reduce_sum(probs * counted[:, None], axis=0)
    return tf.stop_gradient(picked), tf.stop_gradient(tf.reduce_sum(counted)), probability_sums


def load_balancing_loss(
    logits, top_k: int, rows, mask=None, global_sum: Callable | None = None
) -> tf.Tensor:
    """This piece's load-balancing loss from its router `logits` (tokens, experts) of `rows`
    samples: keras_hub's `compute_load_balancing_loss` of the global batch, divided by this
    piece's share of the global batch's rows, `global_sum` adding a vector over every piece
    (None: one piece, the whole batch)."""
    experts = logits.shape[-1]
    picked, counted, probability_sums = routing_sums(logits, top_k, mask)
    rows = tf.cast(rows, tf.float32)
    local = tf.concat([picked, [counted, rows]], axis=0)
    total = local if global_sum is None else tf.stop_gradient(global_sum(local))
    tokens = tf.maximum(total[experts], 1e-9)
    share = 1.0 if global_sum is None else local[experts + 1] / total[experts + 1]
    dispatched = total[:experts] / (top_k * tokens)  # f_e
    return experts * tf.reduce_sum(dispatched * probability_sums) / tokens / share

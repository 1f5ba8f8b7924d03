"""Sparse top-k dispatch: each token through its k experts only (gather, per-expert compute,
weighted sum), the same non-zero terms a dense mixture sums over all experts.

A dense mixture (keras_hub's expert banks) computes every expert on every token and multiplies
the unpicked ones by zero; here the tokens routed to expert `e` are gathered, computed by `e`
alone and stitched back in routing order (`tf.dynamic_partition` / `tf.dynamic_stitch`, whose
gradients are a gather and a stitch), so an expert costs its share of the tokens. The sum over
a token's k picks adds the same products the dense sum adds, less the zeros: equal to float
rounding of the matrix products (GShard, Lepikhin et al. 2020, dispatches the same way, with
a capacity limit this does not impose: no token is dropped).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf


def top_k_mixture(
    tokens: tf.Tensor,
    expert_index: tf.Tensor,
    expert_weight: tf.Tensor,
    num_experts: int,
    expert: Callable[[int, tf.Tensor], tf.Tensor],
) -> tf.Tensor:
    """Σ_j expert_weight[t, j] · expert(expert_index[t, j], tokens[t]) for each token `t`.

    `tokens` (T, H); `expert_index` (T, k) integers in [0, num_experts); `expert_weight` (T, k);
    `expert(e, rows)` maps (n, H) rows to (n, H') through expert `e` alone. Returns (T, H')."""
    picks = tf.shape(expert_index)[1]
    flat = tf.reshape(tf.cast(expert_index, tf.int32), [-1])  # pick p = t * k + j
    per_pick = grouped(flat, num_experts, expert, lambda chosen: tf.gather(tokens, chosen // picks))
    return weighted_sum(per_pick, tokens, expert_weight)


def grouped(
    group: tf.Tensor, groups: int, expert: Callable, rows_of: Callable[[tf.Tensor], tf.Tensor]
) -> tf.Tensor:
    """`expert(group[i], row i)` for each i, in order: the rows of each group (`rows_of(the
    positions)`) computed by their expert together, then stitched back."""
    positions = tf.dynamic_partition(tf.range(tf.size(group)), group, groups)
    outputs = [expert(e, rows_of(positions[e])) for e in range(groups)]
    return tf.dynamic_stitch(positions, outputs)


def weighted_sum(per_pick: tf.Tensor, tokens: tf.Tensor, expert_weight: tf.Tensor) -> tf.Tensor:
    """Each token's k results (`per_pick`, (T * k, H') in pick order) summed by its weights."""
    picks = tf.shape(expert_weight)[1]
    per_pick = tf.reshape(per_pick, [tf.shape(tokens)[0], picks, per_pick.shape[-1]])
    weights = tf.cast(expert_weight, per_pick.dtype)[..., None]
    return tf.reduce_sum(per_pick * weights, axis=1)

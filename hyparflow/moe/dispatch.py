"""Sparse top-k dispatch: each token through its k experts only (gather, per-expert compute,
weighted sum), the same non-zero terms a dense mixture sums over all experts.

A dense mixture (keras_hub's expert banks) computes every expert on every token and multiplies
the unpicked ones by zero; here the tokens routed to expert `e` are gathered, computed by `e`
alone and stitched back in routing order (`tf.dynamic_partition` / `tf.dynamic_stitch`, whose
gradients are a gather and a stitch), so an expert costs its share of the tokens. The sum over
a token's k picks adds the same products the dense sum adds, less the zeros: equal to float
rounding of the matrix products (GShard, Lepikhin et al. 2020, dispatches the same way, with
a capacity limit this imposes only when asked: `within_capacity`; by default no token is
dropped).
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
    capacity_factor: float | None = None,
) -> tf.Tensor:
    """Σ_j expert_weight[t, j] · expert(expert_index[t, j], tokens[t]) for each token `t`.

    `tokens` (T, H); `expert_index` (T, k) integers in [0, num_experts); `expert_weight` (T, k);
    `expert(e, rows)` maps (n, H) rows to (n, H') through expert `e` alone. Returns (T, H').
    With a `capacity_factor`, the picks past an expert's capacity (`within_capacity`) are not
    computed and add nothing."""
    picks = tf.shape(expert_index)[1]
    flat = tf.reshape(tf.cast(expert_index, tf.int32), [-1])  # pick p = t * k + j
    if capacity_factor is None:
        per_pick = grouped(flat, num_experts, expert, lambda c: tf.gather(tokens, c // picks))
        return weighted_sum(per_pick, tokens, expert_weight)
    kept = kept_picks(expert_index, num_experts, capacity_factor)
    rows = lambda c: tf.gather(tokens, tf.gather(kept, c) // picks)  # noqa: E731
    computed = grouped(tf.gather(flat, kept), num_experts, expert, rows)
    return weighted_sum(scattered(computed, kept, tf.size(flat)), tokens, expert_weight)


def within_capacity(expert_index: tf.Tensor, num_experts: int, capacity_factor: float):
    """(T, k) booleans: which picks their expert computes when each expert takes at most
    `ceil(capacity_factor · T · k / num_experts)` of them, first choices before second ones and
    earlier tokens first (GShard's order, Lepikhin et al. 2020; DeepSpeed-MoE's); the others
    are dropped. A factor of `num_experts / k` or more never drops one."""
    tokens, picks = tf.shape(expert_index)[0], tf.shape(expert_index)[1]
    ranked = tf.reshape(tf.transpose(tf.cast(expert_index, tf.int32)), [-1])  # choice-major
    chosen = tf.one_hot(ranked, num_experts, dtype=tf.int32)
    before = tf.reduce_sum(tf.cumsum(chosen, axis=0, exclusive=True) * chosen, axis=1)
    capacity = tf.math.ceil(capacity_factor * tf.cast(tokens * picks, tf.float32) / num_experts)
    kept = before < tf.cast(capacity, tf.int32)
    return tf.transpose(tf.reshape(kept, [picks, tokens]))


def kept_picks(expert_index: tf.Tensor, num_experts: int, capacity_factor: float) -> tf.Tensor:
    """The positions (pick order, t * k + j) of the picks their experts compute under
    `capacity_factor` (`within_capacity`)."""
    kept = tf.where(tf.reshape(within_capacity(expert_index, num_experts, capacity_factor), [-1]))
    return tf.cast(kept[:, 0], tf.int32)


def scattered(rows: tf.Tensor, at: tf.Tensor, size) -> tf.Tensor:
    """`size` rows, `rows[i]` at position `at[i]` and zeros elsewhere (the gradient gathers)."""
    shape = tf.concat([[size], tf.shape(rows)[1:]], axis=0)
    return tf.scatter_nd(at[:, None], rows, shape)


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

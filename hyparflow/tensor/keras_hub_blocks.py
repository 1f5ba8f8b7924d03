"""keras_hub's Transformer blocks, split as Megatron-LM splits them: a table of policies.

keras_hub builds its blocks as opaque layers whose calls are Python code, not a graph, so the
rules cannot find their pairs; like DeepSpeed's AutoTP policies, this table names each block's
sublayers by role, for the classes whose `call` was read (keras_hub 0.32):

- attention: query, key and value projections split by (key-value) heads by column, the output
  projection by row; a dropout on the per-head attention output (batch, seq, heads, dim) draws
  the whole mask; a norm applied to each query or key head (Qwen3-MoE's) keeps its whole
  weights, whose gradient from this rank's heads is summed over the tensor ranks.
  Grouped-query attention splits query and key-value heads alike, so each shard keeps whole
  groups.
- feed-forward: the projections feeding the elementwise product (gated or not) by column, the
  last one by row; the block's other dropouts act on whole tensors after a row layer.

A class not in the table stays whole (its embeddings still split by vocabulary), and so does
a block's attention or feed-forward whose heads or units the tensor ranks do not divide
(grouped-query attention with fewer key-value heads than ranks among them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hyparflow import _keras_hub as hub
from hyparflow.tensor.roles import COLUMN, ROW, split_layer, unsplittable


@dataclass(frozen=True)
class Attention:
    query: str
    key: str
    value: str
    output: str
    dropout: str  # acts on the attention output, heads on axis 2
    inputs: tuple = ("hidden_states",)  # call arguments the projections read
    head_norms: tuple = ()  # norms of each query or key head, after the projections


@dataclass(frozen=True)
class FeedForward:
    columns: tuple  # elementwise-combined projections
    row: str | None  # None: the feed-forward stays whole (e.g. a mixture of experts)
    whole_dropouts: tuple  # dropouts on whole tensors


_LLAMA_STYLE = Attention(hub.QUERY, hub.KEY, hub.VALUE, hub.OUTPUT, hub.ATTENTION_DROPOUT)
_DENSE = FeedForward((hub.FEEDFORWARD_INTERMEDIATE,), hub.FEEDFORWARD_OUTPUT, hub.BLOCK_DROPOUTS)
_GATED = dataclasses.replace(_DENSE, columns=(hub.FEEDFORWARD_GATE, hub.FEEDFORWARD_INTERMEDIATE))
ATTENTION = {
    "LlamaAttention": _LLAMA_STYLE,
    "CachedMistralAttention": _LLAMA_STYLE,
    "Qwen3MoeAttention": dataclasses.replace(_LLAMA_STYLE, head_norms=hub.HEAD_NORMS),
}
FEED_FORWARD = {
    "TransformerEncoder": _DENSE,
    "TransformerDecoder": _DENSE,
    "LlamaTransformerDecoder": _GATED,
    "MistralTransformerDecoder": _GATED,
    "Qwen3MoeTransformerDecoder": FeedForward((), None, hub.BLOCK_DROPOUTS),
}


# keras_hub's subclasses of keras.layers.MultiHeadAttention whose own `call` reads the query,
# key, value and output projections as Keras's does (caching keys and values, rotary positions),
# so they split by heads; other subclasses (XLNet's two-stream relative attention adds its own
# projections of the heads) are kept whole. Moonshine and Whisper measured exact at T=2.
HEAD_SPLIT_ATTENTIONS = frozenset(
    {"CachedMultiHeadAttention", "WhisperCachedMultiHeadAttention", "MoonshineMultiHeadAttention"}
)


def splits_by_heads(layer) -> bool:
    """Whether a `keras.layers.MultiHeadAttention` computes with its projections as Keras's own
    `call` does: no class between it and Keras's overrides `call`, or it is one of keras_hub's
    `HEAD_SPLIT_ATTENTIONS`."""
    for kind in type(layer).__mro__:
        if kind.__module__.startswith("keras.") and kind.__name__ == "MultiHeadAttention":
            return True
        if "call" in vars(kind) and kind.__name__ not in HEAD_SPLIT_ATTENTIONS:
            return False
    return True


def policy(layer, table: dict):
    """`layer`'s entry in `table` (ATTENTION or FEED_FORWARD) when it is keras_hub's own."""
    kind = type(layer)
    return table.get(kind.__name__) if kind.__module__.startswith("keras_hub.") else None


def split_block(layout, layer) -> None:
    """Add `layer`'s splits to `layout` if it is a keras_hub block of the table; an attention
    or a feed-forward whose heads or units the tensor ranks do not divide stays whole."""
    attention = policy(layer, ATTENTION)
    if attention is not None:
        with layout.all_or_none(layer.name, [layer]):
            _split_attention(layout, layer, attention)
    feed_forward = policy(layer, FEED_FORWARD)
    if feed_forward is not None and feed_forward.row is not None:
        columns = [getattr(layer, name) for name in feed_forward.columns]
        row = getattr(layer, feed_forward.row)
        why = next(filter(None, [*map(unsplittable, columns), unsplittable(row, ROW)]), None)
        if why:
            layout.replicated.append(f"{layer.name} feed-forward: {why}")
            return
        reason = f"feed-forward of {layer.name}"
        with layout.all_or_none(reason, [*columns, row]):
            layout.splits += [split_layer(c, COLUMN, layout.parts, reason) for c in columns]
            layout.splits.append(split_layer(row, ROW, layout.parts, reason))


def _split_attention(layout, layer, attention: Attention) -> None:
    parts, reason = layout.parts, f"heads of {layer.name}"
    for name in (attention.query, attention.key, attention.value):
        split = split_layer(getattr(layer, name), COLUMN, parts, reason, heads_axis=1)
        split.input_copied = True
        layout.splits.append(split)
    layout.copies.append((layer, attention.inputs))
    layout.splits.append(split_layer(getattr(layer, attention.output), ROW, parts, reason))
    dropout = getattr(layer, attention.dropout)
    if dropout.rate > 0:
        layout.dropouts.append((dropout, 2))


def split_head_norms(layout, layers) -> list:
    """The per-head norms of the table's attention layers among `layers` whose query or key
    projection `layout` splits (by the rules or a `tensor_layout` override alike)."""
    split = {id(s.layer) for s in layout.splits}
    norms = []
    for layer in layers:
        attention = policy(layer, ATTENTION)
        if attention is None:
            continue
        if any(id(getattr(layer, name)) in split for name in (attention.query, attention.key)):
            norms += [getattr(layer, name) for name in attention.head_norms]
    return norms


def whole_tensor_dropouts(layer) -> set:
    """ids of the dropouts of a keras_hub block of the table that act on whole tensors."""
    feed_forward = policy(layer, FEED_FORWARD)
    if feed_forward is None:
        return set()
    found = [getattr(layer, name, None) for name in feed_forward.whole_dropouts]
    return {id(d) for d in found if d is not None}

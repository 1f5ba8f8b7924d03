"""Every private attribute of keras_hub's layers that hyparflow reads, in one table (keras_hub
0.32), as `_keras.py` holds Keras's: the blocks' sublayers that tensor parallelism splits
(`tensor/keras_hub_blocks.py`) and the routers that sparse expert dispatch calls
(`moe/keras_hub_blocks.py`). `tests/test_private_keras.py` builds the keras_hub models that hold
each class and checks every name in `READ` against the installed keras_hub, and fails on these
names spelled anywhere else.
"""

from __future__ import annotations

# attention projections and the dropout on the per-head attention output (Llama's style)
QUERY, KEY, VALUE, OUTPUT = "_query_dense", "_key_dense", "_value_dense", "_output_dense"
ATTENTION_DROPOUT = "_dropout_layer"
HEAD_NORMS = ("_query_dense_layer_norm", "_key_dense_layer_norm")  # one norm for every head
# a Transformer block's feed-forward, and its dropouts on whole tensors (each where it exists)
FEEDFORWARD_GATE = "_feedforward_gate_dense"
FEEDFORWARD_INTERMEDIATE = "_feedforward_intermediate_dense"
FEEDFORWARD_OUTPUT = "_feedforward_output_dense"
BLOCK_DROPOUTS = ("_self_attention_dropout", "_cross_attention_dropout", "_feedforward_dropout")
# the routers of the mixtures of experts
SPARSE_ROUTER = "_sparse_feedforward_gate_dense"  # Mixtral, Qwen-MoE, Qwen3-MoE
ROUTER_GATE = "_router_gate"  # Qwen3.5-MoE
SHARED_EXPERT_GATE = "_shared_expert_gate"  # Qwen3.5-MoE

_ATTENTION = (QUERY, KEY, VALUE, OUTPUT, ATTENTION_DROPOUT)
_DENSE_FEEDFORWARD = (FEEDFORWARD_INTERMEDIATE, FEEDFORWARD_OUTPUT)
_GATED_FEEDFORWARD = (FEEDFORWARD_GATE, *_DENSE_FEEDFORWARD)
# keras_hub class -> the private attributes read from each of its instances, unconditionally
READ = {
    "LlamaAttention": _ATTENTION,
    "CachedMistralAttention": _ATTENTION,
    "Qwen3MoeAttention": (*_ATTENTION, *HEAD_NORMS),
    "TransformerEncoder": _DENSE_FEEDFORWARD,
    "TransformerDecoder": _DENSE_FEEDFORWARD,
    "LlamaTransformerDecoder": _GATED_FEEDFORWARD,
    "MistralTransformerDecoder": _GATED_FEEDFORWARD,
    "MixtralSparseMoeBlock": (SPARSE_ROUTER,),
    "QwenSparseMoeBlock": (SPARSE_ROUTER,),
    "Qwen3SparseMoeBlock": (SPARSE_ROUTER,),
    "Qwen3_5MoeSparseMoeBlock": (ROUTER_GATE, SHARED_EXPERT_GATE),
}

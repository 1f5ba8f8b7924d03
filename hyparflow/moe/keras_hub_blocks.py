"""keras_hub's mixture-of-experts blocks with sparse dispatch: a table of policies.

keras_hub 0.32's Mixtral and Qwen3-MoE blocks route each token to its top-k experts, then
run every expert on every token (`MixtralMoeExperts`, `Qwen3MoeExperts`: one einsum over all
experts) and multiply the unpicked outputs by zero. For the classes whose `call` was read,
`SparseDispatch` gives the block a call that routes the same way and then hands the tokens,
their picks and weights to the expert bank, whose call computes each expert on its own tokens
only (`dispatch.top_k_mixture`). The expert weights stay read inside the bank's own call, so
ZB-H1 can still replay it for their gradients. The router's load-balancing loss is keras_hub's
formula of the whole global batch (`router_loss`). A block class not in the table keeps its
dense call.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import keras
import tensorflow as tf

from hyparflow import _keras
from hyparflow.moe.dispatch import top_k_mixture
from hyparflow.moe.router_loss import load_balancing_loss


@dataclass(frozen=True)
class Policy:
    """How one keras_hub block class routes and computes its experts."""

    loss_coefficient: str  # the block's attribute scaling its load-balancing loss
    kernels: tuple  # the expert bank's attributes holding (experts, ...) kernels, in order
    expert: Callable  # (bank, one expert's kernels, rows) -> rows through that expert
    normalizes: Callable = lambda block: True  # whether the top-k weights sum to one
    jitter: bool = False  # multiplies tokens by uniform noise in training (Mixtral)


def _gated_expert(bank, kernels, rows):
    """Mixtral: silu(rows @ gate) * (rows @ up) @ down, the activation in float32."""
    gate_kernel, up_kernel, down_kernel = kernels
    gate = tf.cast(bank.activation(tf.cast(rows @ gate_kernel, "float32")), rows.dtype)
    return ((rows @ up_kernel) * gate) @ down_kernel


def _fused_gated_expert(bank, kernels, rows):
    """Qwen3-MoE: one kernel for gate and up, split in halves: (up * silu(gate)) @ down."""
    gate_up_kernel, down_kernel = kernels
    gate, up = tf.split(rows @ gate_up_kernel, 2, axis=-1)
    return (up * bank.activation(gate)) @ down_kernel


_GATE, _UP, _DOWN = (
    f"_expert_feedforward_{part}_dense" for part in ("gate", "intermediate", "output")
)
POLICIES = {  # keras_hub class name -> its policy (keras_hub 0.32)
    "MixtralSparseMoeBlock": Policy(
        "router_aux_loss_coef", (_GATE, _UP, _DOWN), _gated_expert, jitter=True
    ),
    "Qwen3SparseMoeBlock": Policy(
        "router_aux_loss_coefficient",
        (_GATE, _DOWN),
        _fused_gated_expert,
        normalizes=lambda block: bool(block.norm_top_k_prob),
    ),
}


def policy_of(layer) -> Policy | None:
    """The policy of `layer`'s exact class, if keras_hub's (a subclass may have changed call)."""
    kind = type(layer)
    if not kind.__module__.startswith("keras_hub."):
        return None
    return POLICIES.get(kind.__name__)


def router_loss_weight(block) -> float:
    """The coefficient of `block`'s load-balancing loss (0: none), a block of the table."""
    return float(getattr(block, policy_of(block).loss_coefficient))


def sparse_blocks(model) -> list:
    """The layers of `model` that `SparseDispatch` gives a sparse call."""
    return [layer for layer in _keras.all_layers(model) if policy_of(layer) is not None]


def _block_call(policy: Policy, global_sum):
    def call(block, hidden_states, attention_mask=None, training=False):
        shape = tf.shape(hidden_states)
        tokens = tf.reshape(hidden_states, [-1, block.hidden_dim])
        if training and policy.jitter and block.router_jitter_noise > 0:
            noise = block.router_jitter_noise
            tokens = tokens * keras.random.uniform(
                tf.shape(tokens), 1.0 - noise, 1.0 + noise, dtype=tokens.dtype
            )
        logits = block._sparse_feedforward_gate_dense(tokens)
        weight, index = tf.math.top_k(tf.nn.softmax(logits, axis=-1), k=block.top_k)
        if policy.normalizes(block):
            weight = weight / tf.reduce_sum(weight, axis=-1, keepdims=True)
        mixed = block.expert_bank((tokens, index, weight))
        if training:
            rows = shape[0]
            loss = load_balancing_loss(logits, block.top_k, rows, attention_mask, global_sum)
            block.add_loss(getattr(block, policy.loss_coefficient) * loss)
        return tf.reshape(mixed, shape), logits

    return call


def _bank_call(policy: Policy):
    def call(bank, hidden_states):
        tokens, index, weight = hidden_states  # one argument: the bank's call signature
        # each kernel read whole once and cut per expert: a dense gradient, as the dense einsum
        # gives (a gather's would be row slices, which optimizers apply differently)
        kernels = [
            tf.unstack(keras.ops.convert_to_tensor(getattr(bank, name))) for name in policy.kernels
        ]
        expert = lambda e, rows: policy.expert(bank, [k[e] for k in kernels], rows)  # noqa: E731
        return top_k_mixture(tokens, index, weight, bank.num_experts, expert)

    return call


class SparseDispatch:
    """While entered, the model's keras_hub mixture blocks in `POLICIES` compute each token
    through its top-k experts only, and their load-balancing loss as this piece's part of the
    global batch's (`router_loss`; `global_sum` sums a vector over the pieces, in the step);
    on the last exit they have their own calls again. With `model` None, it changes nothing
    (the blocks stay dense, with keras_hub's loss of each piece)."""

    def __init__(self, model=None, global_sum=None):
        self.blocks = [] if model is None else sparse_blocks(model)
        self.global_sum = global_sum
        self.depth = 0  # entered again inside itself: the calls stay until the outer exit

    def __enter__(self):
        self.depth += 1
        for block in self.blocks if self.depth == 1 else ():
            policy = policy_of(block)
            block.call = types.MethodType(_block_call(policy, self.global_sum), block)
            block.expert_bank.call = types.MethodType(_bank_call(policy), block.expert_bank)
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        for block in self.blocks if self.depth == 0 else ():
            vars(block).pop("call", None)
            vars(block.expert_bank).pop("call", None)
        return False

"""keras_hub's mixture-of-experts blocks with sparse dispatch: a table of policies.

keras_hub 0.32's Mixtral, Qwen-MoE, Qwen3-MoE, Qwen3.5-MoE and gpt-oss blocks route each token
to its top-k experts, then run every expert on every token (`MixtralMoeExperts`,
`QwenMoeExperts`, ...: one einsum over all experts) and multiply the unpicked outputs by zero;
Qwen-MoE and Qwen3.5-MoE add a shared expert that every token goes through, gated by a sigmoid.
For the classes whose `call` was read, `SparseDispatch` gives the block a call that routes the
same way and then hands the tokens, their picks and weights to the expert bank, whose call
computes each expert on its own tokens only (`dispatch.top_k_mixture`). The expert weights stay
read inside the bank's own call, so ZB-H1 can still replay it for their gradients. The router's
load-balancing loss (all but gpt-oss, which has none) is keras_hub's formula of the whole
global batch (`router_loss`). A block class not in the table keeps its dense call.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import keras
import tensorflow as tf

from hyparflow import _keras
from hyparflow import _keras_hub as hub
from hyparflow.comm.traffic import TrafficLog
from hyparflow.intercept import instead, replaced_calls
from hyparflow.moe.dispatch import top_k_mixture
from hyparflow.moe.expert_parallel import expert_parallel_mixture
from hyparflow.moe.router_loss import load_balancing_loss, routing_sums
from hyparflow.moe.router_tally import RoutedBlock


@dataclass(frozen=True)
class Policy:
    """How one keras_hub block class routes and computes its experts."""

    # (block, tokens, training) -> router logits, picks (T, k), weights (T, k), and the tokens
    # the experts compute (Mixtral's jittered in training)
    route: Callable
    bank: str  # the block's attribute holding its expert bank
    kernels: tuple  # the bank's attributes holding (experts, ...) weights, in `expert`'s order
    expert: Callable  # (bank, one expert's weights, rows) -> rows through that expert
    loss_coefficient: str | None = None  # the block's load-balancing loss coefficient
    scores: bool = False  # returns (T, E) routing weights beside its output, not the logits
    shared: Callable | None = None  # (block, tokens) -> the shared expert's gated rows


def _softmax_route(normalizes: Callable, jitter: bool = False, router: str = hub.SPARSE_ROUTER):
    """Mixtral and the Qwen mixtures: softmax over all experts of the `router` Dense's logits,
    then the top k, whose weights are normalised to sum to one where `normalizes(block)`;
    Mixtral's tokens jittered in training."""

    def route(block, tokens, training):
        noise = getattr(block, "router_jitter_noise", 0.0) if jitter and training else 0.0
        if noise > 0:
            uniform = keras.random.uniform(tf.shape(tokens), 1.0 - noise, 1.0 + noise)
            tokens = tokens * tf.cast(uniform, tokens.dtype)
        logits = getattr(block, router)(tokens)
        weight, index = tf.math.top_k(tf.nn.softmax(logits, axis=-1), k=block.top_k)
        if normalizes(block):
            weight = weight / tf.reduce_sum(weight, axis=-1, keepdims=True)
        return logits, index, weight, tokens

    return route


def _top_logits_route(block, tokens, training):
    """gpt-oss: the top k logits, softmax over those k only."""
    logits = block.router.router_dense(tokens)
    top, index = tf.math.top_k(logits, k=block.top_k)
    return logits, index, tf.nn.softmax(top, axis=-1), tokens


def _gated_expert(bank, weights, rows):
    """Mixtral: silu(rows @ gate) * (rows @ up) @ down, the activation in float32."""
    gate_kernel, up_kernel, down_kernel = weights
    gate = tf.cast(bank.activation(tf.cast(rows @ gate_kernel, "float32")), rows.dtype)
    return ((rows @ up_kernel) * gate) @ down_kernel


def _fused_gated_expert(bank, weights, rows):
    """Qwen-MoE and Qwen3-MoE: one kernel for gate and up, split in halves:
    (up * silu(gate)) @ down."""
    gate_up_kernel, down_kernel = weights
    gate, up = tf.split(rows @ gate_up_kernel, 2, axis=-1)
    return (up * bank.activation(gate)) @ down_kernel


def _fused_float32_gated_expert(bank, weights, rows):
    """Qwen3.5-MoE: as Qwen3-MoE's, the silu in float32 (its bank names no activation)."""
    gate_up_kernel, down_kernel = weights
    gate, up = tf.split(rows @ gate_up_kernel, 2, axis=-1)
    return (up * tf.cast(tf.nn.silu(tf.cast(gate, "float32")), rows.dtype)) @ down_kernel


def _gated_shared_expert(expert: str, gate: str):
    """Qwen-MoE and Qwen3.5-MoE: the block's `expert` MLP of every token, times the sigmoid of
    its one-unit `gate` Dense."""

    def shared(block, tokens):
        return getattr(block, expert)(tokens) * tf.sigmoid(getattr(block, gate)(tokens))

    return shared


def _clamped_glu_expert(bank, weights, rows):
    """gpt-oss: gate and up interleaved in one biased projection, clamped at `limit`, then
    (up + 1) * gate * sigmoid(alpha * gate) through a biased down projection."""
    gate_up_kernel, gate_up_bias, down_kernel, down_bias = weights
    gate_up = rows @ gate_up_kernel + gate_up_bias
    gate = tf.minimum(tf.maximum(gate_up[:, ::2], -1e9), bank.limit)
    up = tf.clip_by_value(gate_up[:, 1::2], -bank.limit, bank.limit)
    glu = gate * tf.sigmoid(gate * bank.alpha)
    return ((up + 1) * glu) @ down_kernel + down_bias


_GATE, _UP, _DOWN = (
    f"_expert_feedforward_{part}_dense" for part in ("gate", "intermediate", "output")
)
POLICIES = {  # keras_hub class name -> its policy (keras_hub 0.32)
    "MixtralSparseMoeBlock": Policy(
        _softmax_route(lambda block: True, jitter=True), "expert_bank", (_GATE, _UP, _DOWN),
        _gated_expert, loss_coefficient="router_aux_loss_coef",
    ),
    "QwenSparseMoeBlock": Policy(
        _softmax_route(lambda block: bool(block.norm_top_k_prob)), "expert_bank", (_GATE, _DOWN),
        _fused_gated_expert, loss_coefficient="router_aux_loss_coefficient",
        shared=_gated_shared_expert("shared_expert_dense", "shared_expert_gate_dense"),
    ),
    "Qwen3SparseMoeBlock": Policy(
        _softmax_route(lambda block: bool(block.norm_top_k_prob)), "expert_bank", (_GATE, _DOWN),
        _fused_gated_expert, loss_coefficient="router_aux_loss_coefficient",
    ),
    "Qwen3_5MoeSparseMoeBlock": Policy(
        _softmax_route(lambda block: True, router=hub.ROUTER_GATE), "expert_bank",
        (_GATE, _DOWN), _fused_float32_gated_expert,
        loss_coefficient="router_aux_loss_coefficient",
        shared=_gated_shared_expert("shared_expert", hub.SHARED_EXPERT_GATE),
    ),
    "GptOssSparseMoeBlock": Policy(
        _top_logits_route, "experts",
        ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
        _clamped_glu_expert, scores=True,
    ),
}  # fmt: skip


def policy_of(layer) -> Policy | None:
    """The policy of `layer`'s exact class, if keras_hub's (a subclass may have changed call)."""
    kind = type(layer)
    if not kind.__module__.startswith("keras_hub."):
        return None
    return POLICIES.get(kind.__name__)


def router_loss_weight(block) -> float:
    """The coefficient of `block`'s load-balancing loss (0: none), a block of the table."""
    name = policy_of(block).loss_coefficient
    return 0.0 if name is None else float(getattr(block, name))


def sparse_blocks(model) -> list:
    """The layers of `model` that `SparseDispatch` gives a sparse call."""
    return [layer for layer in _keras.all_layers(model) if policy_of(layer) is not None]


def _add_router_loss(block, logits, rows, mask, global_sum, tally) -> None:
    """The block's load-balancing loss as this piece's part of the global batch's, or, with a
    `tally` (micro-batches), its counts and sums recorded there (`router_tally.py`)."""
    weight = router_loss_weight(block)
    if tally is None:
        loss = load_balancing_loss(logits, block.top_k, rows, mask, global_sum)
        block.add_loss(weight * loss)
    elif weight:
        picked, tokens, sums = routing_sums(logits, block.top_k, mask)
        tally.record(RoutedBlock(logits.shape[-1], block.top_k, weight), picked, tokens, rows, sums)


def _block_call(policy: Policy, global_sum, tally):
    def call(block, hidden_states, attention_mask=None, training=False):
        shape = tf.shape(hidden_states)
        flat = tf.reshape(hidden_states, [-1, block.hidden_dim])
        logits, index, weight, tokens = policy.route(block, flat, training)
        mixed = getattr(block, policy.bank)((tokens, index, weight))
        if policy.shared is not None:
            mixed = mixed + policy.shared(block, flat)
        if training and policy.loss_coefficient is not None:
            _add_router_loss(block, logits, shape[0], attention_mask, global_sum, tally)
        if policy.scores:  # each token's weight for each expert, 0 where not picked
            one_hot = tf.one_hot(index, block.num_experts, dtype=weight.dtype)
            return tf.reshape(mixed, shape), tf.reduce_sum(one_hot * weight[..., None], axis=1)
        return tf.reshape(mixed, shape), logits

    return call


def _bank_call(policy: Policy, expert_comm, traffic, capacity_factor):
    def call(bank, hidden_states):
        tokens, index, weight = hidden_states  # one argument: the bank's call signature
        # each kernel read whole once and cut per expert: a dense gradient, as the dense einsum
        # gives (a gather's would be row slices, which optimizers apply differently); under
        # expert parallelism the bank holds this rank's experts only
        kernels = [
            tf.unstack(keras.ops.convert_to_tensor(getattr(bank, name))) for name in policy.kernels
        ]
        expert = lambda e, rows: policy.expert(bank, [k[e] for k in kernels], rows)  # noqa: E731
        if expert_comm is None:
            return top_k_mixture(tokens, index, weight, bank.num_experts, expert, capacity_factor)
        return expert_parallel_mixture(
            tokens, index, weight, bank.num_experts, expert, expert_comm, traffic, capacity_factor
        )

    return call


class SparseDispatch:
    """While entered, the model's keras_hub mixture blocks in `POLICIES` compute each token
    through its top-k experts only, and their load-balancing loss as this piece's part of the
    global batch's (`router_loss`; `global_sum` sums a vector over the pieces, in the step);
    on the last exit they have their own calls again. With `model` None, it changes nothing
    (the blocks stay dense, with keras_hub's loss of each piece). With `expert_comm`, the banks
    hold the experts of this rank of it (`ExpertShards`) and exchange tokens over it, counted
    in `traffic` (a `TrafficLog`; one of the dispatch's own when not given). With a
    `tally` (`RouterTally`: a step of several micro-batches), a training call records its
    routing there instead of adding its loss. With a `capacity_factor`, each expert computes at
    most its capacity of the picks (`dispatch.within_capacity`; not exact)."""

    def __init__(
        self,
        model=None,
        global_sum=None,
        expert_comm=None,
        tally=None,
        capacity_factor=None,
        traffic=None,
    ):
        self.blocks = [] if model is None else sparse_blocks(model)
        self.global_sum = global_sum
        self.tally = tally
        self.capacity_factor = capacity_factor
        self.expert_comm = expert_comm
        self.traffic = TrafficLog() if traffic is None else traffic
        # entered again inside itself, the calls stay until the outer exit (`intercept.py`)
        self._calls = replaced_calls(self._sparse_calls())

    def _sparse_calls(self):
        """(layer, make) of each block's routed call and of its expert bank's sparse one."""
        for block in self.blocks:
            policy = policy_of(block)
            bank = getattr(block, policy.bank)
            block_call = _block_call(policy, self.global_sum, self.tally)
            bank_call = _bank_call(policy, self.expert_comm, self.traffic, self.capacity_factor)
            yield block, instead(types.MethodType(block_call, block))
            yield bank, instead(types.MethodType(bank_call, bank))

    def __enter__(self):
        self._calls.__enter__()
        return self

    def __exit__(self, *exc):
        return self._calls.__exit__(*exc)

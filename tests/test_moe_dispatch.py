"""Sparse expert dispatch (hyparflow/moe) equals the dense mixtures it replaces.

`top_k_mixture` against the dense sum over all experts, and keras_hub's Mixtral and Qwen3-MoE
blocks under `SparseDispatch` against their own dense calls: outputs, router logits, the
router's load-balancing loss (on, with a padding mask) and every gradient."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
from hyparflow.moe import RouterTally, SparseDispatch, sparse_blocks
from hyparflow.moe.dispatch import top_k_mixture, within_capacity
from hyparflow.moe.in_keras import sparse_in_keras
from tests.support import zoo
from tests.support.compare import relative_difference

TOLERANCE = 1e-5
# two one-process fits of the tiny Mixtral, 2 epochs of SGD with momentum: Keras alone, every
# initial weight moved by 1e-7 relative, ends 2.6e-5 from its own run on an AMD EPYC without
# AVX-512, and sparse dispatch reorders the experts' sums (1.4e-5 there)
ONE_PROCESS_FIT_TOLERANCE = 1e-4


def _dense_mixture(tokens, index, weight, kernels):
    """Every expert on every token, the unpicked ones weighted 0 (what keras_hub computes)."""
    every = tf.einsum("th,ehm->etm", tokens, kernels)
    routing = tf.reduce_sum(tf.one_hot(index, kernels.shape[0]) * weight[..., None], axis=1)
    return tf.reduce_sum(every * tf.transpose(routing)[..., None], axis=0)


@pytest.mark.parametrize("picks", [1, 2, 3])
def test_top_k_mixture_equals_the_dense_sum_and_its_gradients(picks):
    rng = np.random.default_rng(picks)
    experts, rows = 5, 12
    tokens = tf.constant(rng.normal(size=(rows, 4)), tf.float32)
    kernels = tf.Variable(rng.normal(size=(experts, 4, 3)), dtype=tf.float32)
    # distinct picks per token, expert 4 never picked: an expert with no tokens
    index = tf.constant(np.stack([rng.permutation(4)[:picks] for _ in range(rows)]))
    weight = tf.constant(rng.uniform(size=(rows, picks)), tf.float32)
    results = []
    for mixture in (
        lambda: top_k_mixture(
            tokens, index, weight, experts, lambda e, x: x @ tf.unstack(kernels.value())[e]
        ),
        lambda: _dense_mixture(tokens, index, weight, kernels),
    ):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([tokens, weight])
            out = mixture()
            loss = tf.reduce_sum(out * tf.range(1.0, 4.0))
        grads = tape.gradient(loss, [tokens, weight, kernels])
        results.append([out, *map(tf.convert_to_tensor, grads)])
    for sparse, dense in zip(*results, strict=True):
        np.testing.assert_allclose(sparse, dense, atol=TOLERANCE, rtol=TOLERANCE)
    assert not np.any(results[0][3][4]), "the unpicked expert gets no gradient"


def test_capacity_keeps_first_choices_then_earlier_tokens():
    # 4 tokens, top-2 of 4 experts, factor 1: each expert computes ceil(1 * 4 * 2 / 4) = 2 picks;
    # expert 0 takes the first choices of tokens 0 and 1, not token 2's, nor token 3's second
    index = tf.constant([[0, 1], [0, 2], [0, 1], [3, 0]])
    kept = within_capacity(index, 4, 1.0).numpy()
    assert kept.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert within_capacity(index, 4, 2.0).numpy().all(), "E / k never drops a pick"
    assert within_capacity(index, 4, 0.5).numpy().sum() == 4  # one pick for each expert


def test_a_capacity_drops_exactly_the_picks_past_it_with_their_gradients():
    """Picks past their expert's capacity add nothing: the mixture with them weighted 0, in
    value and gradients; with a factor that drops none, the mixture without a capacity."""
    rng = np.random.default_rng(7)
    experts, rows, picks = 4, 12, 2
    tokens = tf.constant(rng.normal(size=(rows, 4)), tf.float32)
    kernels = tf.Variable(rng.normal(size=(experts, 4, 3)), dtype=tf.float32)
    index = tf.constant(np.stack([rng.permutation([0, 0, 1, 2])[:picks] % 4 for _ in range(rows)]))
    weight = tf.constant(rng.uniform(size=(rows, picks)), tf.float32)
    expert = lambda e, x: x @ tf.unstack(kernels.value())[e]  # noqa: E731
    kept = within_capacity(index, experts, 1.0)
    assert 0 < int(tf.reduce_sum(tf.cast(kept, tf.int32))) < rows * picks, "some dropped"
    zeroed = tf.where(kept, weight, 0.0)
    results = []
    for mixture in (
        lambda: top_k_mixture(tokens, index, weight, experts, expert, capacity_factor=1.0),
        lambda: top_k_mixture(tokens, index, zeroed, experts, expert),
        lambda: top_k_mixture(tokens, index, weight, experts, expert, capacity_factor=2.0),
        lambda: top_k_mixture(tokens, index, weight, experts, expert),
    ):
        with tf.GradientTape() as tape:
            tape.watch(tokens)
            out = mixture()
            loss = tf.reduce_sum(out * tf.range(1.0, 4.0))
        results.append([out, *map(tf.convert_to_tensor, tape.gradient(loss, [tokens, kernels]))])
    for pair in (results[:2], results[2:]):
        for capped, reference in zip(*pair, strict=True):
            np.testing.assert_allclose(capped, reference, atol=TOLERANCE, rtol=TOLERANCE)
    assert not np.allclose(results[0][0], results[3][0]), "dropping changes the mixture"


def _mixtral():
    import keras_hub

    backbone = keras_hub.models.MixtralBackbone(
        **dict(zoo.MIXTRAL, num_layers=1), router_aux_loss_coef=0.5
    )
    return backbone.transformer_layers[0]._sparse_moe_block


def _qwen3_moe(normalize: bool):
    import keras_hub

    backbone = keras_hub.models.Qwen3MoeBackbone(
        **dict(zoo.QWEN3_MOE, num_layers=1),
        num_key_value_heads=1,
        router_aux_loss_coefficient=0.5,
        norm_top_k_prob=normalize,
    )
    return backbone.transformer_layers[0].mlp


def _qwen_moe(normalize: bool):
    """Qwen-MoE's block: Qwen3-MoE's routing and experts beside a shared expert, its gate a
    sigmoid."""
    import keras_hub

    backbone = keras_hub.models.QwenMoeBackbone(
        **dict(zoo.QWEN_MOE, num_layers=1),
        norm_top_k_prob=normalize,
        router_aux_loss_coefficient=0.5,
    )
    return backbone.transformer_layers[0].mlp


def _qwen3_5_moe():
    """Qwen3.5-MoE's block: normalised top-k routing, a shared expert, the silu in float32."""
    from keras_hub.src.models.qwen3_5_moe.qwen3_5_moe_decoder import Qwen3_5MoeSparseMoeBlock

    block = Qwen3_5MoeSparseMoeBlock(
        16, 8, 12, num_experts=4, top_k=2, router_aux_loss_coefficient=0.5
    )
    block.build((None, None, 16))
    return block


def _router(block):
    """The router Dense's kernel of a block of the policy table."""
    router = getattr(block, "_router_gate", None) or block._sparse_feedforward_gate_dense
    return router.kernel


def _gpt_oss():
    """gpt-oss's block (no router loss; biased, clamped experts), its biases made non-zero."""
    from keras_hub.src.models.gpt_oss.gpt_oss_decoder import GptOssSparseMoeBlock

    block = GptOssSparseMoeBlock(16, 8, num_experts=4, top_k=2)
    block.build((None, None, 16))
    rng = np.random.default_rng(2)
    for bias in (block.experts.gate_up_proj_bias, block.experts.down_proj_bias):
        bias.assign(rng.normal(size=bias.shape))
    return block


def _block_and_batch(make, square_mask: bool | None, seed: int):
    """A block and 3 sequences of 5 tokens with 0-2 padded: a (batch, length) mask, its
    (batch, length, length) attention form (`square_mask`), or none (None)."""
    keras.utils.set_random_seed(0)
    block = make()
    hidden = tf.constant(np.random.default_rng(seed).normal(size=(3, 5, 16)), tf.float32)
    mask = tf.constant([[True] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False]])
    if square_mask:
        mask = mask[:, :, None] & mask[:, None, :]
    return block, hidden, None if square_mask is None else mask


def _run(block, hidden, mask):
    """The block's output, router logits (gpt-oss: routing weights), added loss and gradients of
    a loss of all three."""
    with tf.GradientTape() as tape:
        tape.watch(hidden)
        if mask is None:  # gpt-oss's call takes the hidden states only
            out, logits = block(hidden)
        else:
            out, logits = block(hidden, attention_mask=mask, training=True)
        added = tf.add_n(block.losses) if block.losses else tf.constant(0.0)
        loss = tf.reduce_sum(out**2) + tf.reduce_sum(logits) + added
    grads = tape.gradient(loss, [hidden, *block.trainable_variables])
    assert not any(isinstance(g, tf.IndexedSlices) for g in grads), "dense, as Keras's"
    return [out, logits, added, *grads]


@pytest.mark.parametrize(
    "make, square_mask",
    [
        (_mixtral, False),
        (lambda: _qwen3_moe(True), True),
        (lambda: _qwen3_moe(False), True),
        (lambda: _qwen_moe(False), True),
        (lambda: _qwen_moe(True), True),
        (_qwen3_5_moe, False),
        (_gpt_oss, None),
    ],
    ids=[
        "mixtral",
        "qwen3_moe",
        "qwen3_moe_unnormalized",
        "qwen_moe",
        "qwen_moe_normalized",
        "qwen3_5_moe",
        "gpt_oss",
    ],
)
def test_keras_hub_blocks_compute_as_their_dense_calls(make, square_mask):
    """With the mask each decoder hands its block: Mixtral's and Qwen3.5-MoE's padding mask,
    Qwen-MoE's and Qwen3-MoE's self-attention mask (its loss keeps a token that attends to
    anything), none for gpt-oss."""
    block, hidden, mask = _block_and_batch(make, square_mask, seed=0)
    dense = _run(block, hidden, mask)
    with SparseDispatch(block) as dispatch:
        assert dispatch.blocks == [block]
        sparse = _run(block, hidden, mask)
        graph = tf.function(lambda h: block(h)).get_concrete_function(hidden)
    bank = getattr(block, "expert_bank", None) or block.experts
    assert "call" not in vars(block) and "call" not in vars(bank), "calls restored"
    assert {"DynamicPartition", "DynamicStitch"} <= {op.type for op in graph.graph.get_operations()}
    for a, b in zip(sparse, dense, strict=True):
        np.testing.assert_allclose(a, b, atol=TOLERANCE, rtol=TOLERANCE)


def test_only_the_blocks_of_the_table_go_sparse():
    keras.utils.set_random_seed(0)
    model = zoo.qwen3_moe()
    blocks = sparse_blocks(model)
    assert len(blocks) == 2 and all(type(b).__name__ == "Qwen3SparseMoeBlock" for b in blocks)
    assert sparse_blocks(zoo.llama()) == []
    with SparseDispatch(None) as nothing:  # strategy sparse_experts=False
        assert nothing.blocks == []


# The blocks with a router loss (gpt-oss has none), each with the mask its decoder hands it
ROUTER_LOSS_BLOCKS = [
    pytest.param(_mixtral, False, id="mixtral"),
    pytest.param(lambda: _qwen3_moe(True), True, id="qwen3_moe"),
    pytest.param(lambda: _qwen_moe(False), True, id="qwen_moe"),
    pytest.param(_qwen3_5_moe, False, id="qwen3_5_moe"),
]


def _router_loss_and_gradient(block, hidden, mask, share=1.0):
    """`share` x the block's added loss, and its gradient for the router's kernel."""
    router = _router(block)
    with tf.GradientTape() as tape:
        block(hidden, attention_mask=mask, training=True)
        loss = share * tf.add_n(block.losses)
    return loss, tape.gradient(loss, router.value)


@pytest.mark.parametrize("make, square_mask", ROUTER_LOSS_BLOCKS)
def test_pieces_of_a_batch_sum_to_the_router_loss_of_the_whole(make, square_mask):
    """Two pieces (2 and 1 rows), each adding the other's counts through `global_sum` and
    weighted by its share of the rows as the engine weights added losses, give keras_hub's loss
    of the whole batch and its gradient; each piece's own keras_hub loss does not."""
    block, hidden, mask = _block_and_batch(make, square_mask, seed=1)
    whole_loss, whole_grad = _router_loss_and_gradient(block, hidden, mask)  # keras_hub's
    pieces = [slice(0, 2), slice(2, 3)]
    naive = sum(
        _router_loss_and_gradient(block, hidden[p], mask[p], share=(p.stop - p.start) / 3)[0]
        for p in pieces
    )
    differs = abs(float(naive - whole_loss)) / float(whole_loss)
    assert differs > 10 * TOLERANCE, "the pieces' own keras_hub losses are not the whole's"
    sums = []
    for p in pieces:  # each piece's counts, tokens and rows, as the allreduce would see them
        with SparseDispatch(block, global_sum=lambda t: sums.append(t) or t):
            block(hidden[p], attention_mask=mask[p], training=True)
    loss, grad = 0.0, 0.0
    for p, others in zip(pieces, (sums[1], sums[0]), strict=True):
        with SparseDispatch(block, global_sum=lambda t, others=others: t + others):
            piece = _router_loss_and_gradient(
                block, hidden[p], mask[p], share=(p.stop - p.start) / 3
            )
        loss, grad = loss + piece[0], grad + piece[1]
    np.testing.assert_allclose(loss, whole_loss, rtol=TOLERANCE)
    np.testing.assert_allclose(grad, whole_grad, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("make, square_mask", ROUTER_LOSS_BLOCKS)
def test_a_tally_of_micro_batches_gives_the_router_loss_of_the_whole(make, square_mask):
    """Two micro-batches (2 rows, then 1) record their routing in a `RouterTally` instead of
    adding a loss; once both have run forward, the gradient it gives each one's probability
    sums (scaled by its share of the rows, as a stage returns them) and the values it reports
    are keras_hub's loss of the whole batch and its router gradient."""
    block, hidden, mask = _block_and_batch(make, square_mask, seed=1)
    whole_loss, whole_grad = _router_loss_and_gradient(block, hidden, mask)  # keras_hub's
    router = _router(block)
    tally, taped = RouterTally(), []
    with SparseDispatch(block, tally=tally):
        for k, p in enumerate([slice(0, 2), slice(2, 3)]):
            with tf.GradientTape() as tape:
                block(hidden[p], attention_mask=mask[p], training=True)
                counts, sums = tally.collect()
                scaled = sums * (p.stop - p.start) / 3
            assert not block.losses, "a tallied block adds no loss of its own"
            tally.forwarded(k, counts, sums)
            taped.append((tape, scaled))
    grad = sum(
        tape.gradient(scaled, router.value, output_gradients=tally.output_gradient(k))
        for k, (tape, scaled) in enumerate(taped)
    )
    loss = sum(rows * value for rows, value in tally.take_parts()) / 3
    np.testing.assert_allclose(loss, whole_loss, rtol=TOLERANCE)
    np.testing.assert_allclose(grad, whole_grad, rtol=TOLERANCE, atol=TOLERANCE)
    assert tally.take_parts() == [], "the next step starts empty"


def test_router_losses_take_micro_batches_in_gpipe_order_only():
    import hyparflow as hf
    from hyparflow.model_checks import check_router_losses

    keras.utils.set_random_seed(0)
    model = zoo.mixtral()  # router loss 0.1
    check_router_losses(model, hf.Strategy("model", partitions=2, microbatches=2))  # GPipe
    check_router_losses(model, hf.Strategy("hybrid", partitions=2, replicas=2))  # replicas: exact
    for strategy in (
        hf.Strategy("model", partitions=2, microbatches=2, schedule="1f1b"),
        hf.Strategy("model", partitions=2, microbatches=2, schedule="zero_bubble"),
        hf.Strategy("data", replicas=2, microbatches=2, overlap_groups=2),
    ):
        with pytest.raises(ValueError, match=r"router load-balancing loss.*schedule='gpipe'"):
            check_router_losses(model, strategy)
    # dense blocks keep keras_hub's loss per piece, with the warning; no loss, nothing to refuse
    one_f_one_b = hf.Strategy("model", partitions=2, microbatches=2, schedule="1f1b")
    check_router_losses(model, dataclasses.replace(one_f_one_b, sparse_experts=False))
    check_router_losses(zoo.gpt_oss(), one_f_one_b)  # gpt-oss adds no router loss


def _one_process_fit(fit, model=None, **options):
    """A tiny Mixtral (`model`, or a new one) trained by `fit` (model.fit or hf.fit in this one
    process), and for each step whether its blocks ran hyparflow's sparse calls."""
    x, y, batch_size, epochs = zoo.training_data("mixtral", False)
    model = model or zoo.compiled("mixtral", "sgd")
    blocks = sparse_blocks(model)
    sparse = []
    probe = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda *_, **__: sparse.append(all("call" in vars(b) for b in blocks))
    )
    history = fit(
        model,
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[probe],
        **options,
    )
    assert not any("call" in vars(b) for b in blocks), "the blocks' own calls again"
    return model, history.history, sparse


def test_one_process_fit_is_model_fit_with_the_experts_dispatched_sparsely():
    """Without a launcher hf.fit is model.fit, keras_hub's mixture blocks sparse while it runs
    (within float rounding of Keras's dense fit, its router loss included);
    `sparse_experts=False` is model.fit exactly."""
    keras_fit = lambda model, x, y, **kw: model.fit(x, y, **kw)  # noqa: E731
    dense, dense_history, dense_steps = _one_process_fit(keras_fit)
    model, history, steps = _one_process_fit(hf.fit)
    assert steps and all(steps) and not any(dense_steps)
    difference = relative_difference(model.get_weights(), dense.get_weights())
    assert difference < ONE_PROCESS_FIT_TOLERANCE
    for key, values in dense_history.items():
        np.testing.assert_allclose(history[key], values, rtol=ONE_PROCESS_FIT_TOLERANCE)
    plain, plain_history, plain_steps = _one_process_fit(
        hf.fit, strategy=hf.Strategy("data", sparse_experts=False)
    )
    assert not any(plain_steps) and plain_history == dense_history
    for a, b in zip(plain.get_weights(), dense.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # the same call of Keras's: same bytes
    # Keras keeps the step it compiled around the sparse calls, and drops a dense one
    compiled = model.train_function
    _, _, again = _one_process_fit(hf.fit, model=model)
    assert all(again) and model.train_function is compiled, "hf.fit again: no new trace"
    model.fit(zoo.training_data("mixtral", False)[0], epochs=1, verbose=0)  # Keras's own
    assert model.train_function is compiled, "a plain fit reuses the sparse step"
    traced_dense = dense.train_function
    _, _, retraced = _one_process_fit(hf.fit, model=dense)
    assert all(retraced) and dense.train_function is not traced_dense, "traced sparse again"


def test_a_model_compiled_for_xla_keeps_its_dense_experts():
    """tf.dynamic_partition's data-dependent shapes do not compile under XLA."""
    keras.utils.set_random_seed(0)
    model = zoo.compiled("mixtral", "sgd")
    with sparse_in_keras(model) as dispatch:
        assert len(dispatch.blocks) == 2
    model.jit_compile = True
    with sparse_in_keras(model) as dispatch:
        assert dispatch.blocks == []

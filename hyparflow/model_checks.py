"""Refuse, before any rank trains, models and inputs that hf.fit would train unlike Keras."""

from __future__ import annotations

import keras
import numpy as np
from keras import tree

from hyparflow import _keras
from hyparflow.engine.keras_semantics.batch_coupling import COUPLING_TOLERANCE, sample_coupling
from hyparflow.engine.keras_semantics.random_slices import unsliceable_random_layers
from hyparflow.engine.keras_semantics.sync_batchnorm import synchronized_layers
from hyparflow.engine.sharded_optimizer.refusal import refusal as zero_refusal
from hyparflow.engine.sharded_optimizer.refusal import weights_refusal
from hyparflow.engine.stages.structure import model_input_list
from hyparflow.moe import expert_weights, router_loss_weight, sparse_blocks
from hyparflow.own_steps import own_steps
from hyparflow.tensor.roles import check_elementwise


def check_compiled(model) -> None:
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The model is not compiled; call model.compile(optimizer=..., loss=...) before hf.fit."
        )


def check_standard_steps(model, strategy=None) -> None:
    """Refuse a model that overrides Keras's step or loss where hf.fit cannot run it: only
    data parallelism runs the whole model per replica (engine/custom_step.py); a pipeline or
    tensor split runs its own step, so that custom logic would silently not run."""
    if getattr(model, "preprocessor", None) is not None and hasattr(model, "preprocess_samples"):
        raise ValueError(
            f"{type(model).__name__} has a preprocessor, which its own fit runs on the data and "
            "hf.fit would not: build the task with preprocessor=None and preprocess the data "
            "first (e.g. dataset.map(preprocessor))."
        )
    names = own_steps(model)
    if not names:
        return
    split = strategy is None or strategy.partitions > 1 or strategy.tensor > 1
    if split or strategy.microbatches > 1:
        layout = "a pipeline or tensor split" if split else "micro-batches"
        raise ValueError(
            f"{type(model).__name__} overrides Model.{names[0]}, which hf.fit cannot run with "
            f"{layout} (it runs its own step there, so the override would be skipped). "
            'Train it with strategy="data" (each replica runs the step on its share of the '
            "batch, num_microbatches=1), move that logic into layers, losses or metrics, or "
            "train it with model.fit on one process."
        )
    _check_custom_step_options(model, strategy, names[0])


def _check_custom_step_options(model, strategy, name: str) -> None:
    """What a replica running the model's own step cannot do exactly."""
    what = f"{type(model).__name__} overrides Model.{name}, which each replica runs itself"
    synced = _global_batchnorm(model, strategy)
    if synced and strategy.replicas > 1:
        raise ValueError(
            f"{what}: BatchNormalization layers {synced} cannot sum their statistics over the "
            "replicas inside it; use synchronized=False and sync_batchnorm=False."
        )


def _global_batchnorm(model, strategy) -> list[str]:
    """The first five of the model's BatchNormalization layers that normalise by the whole
    global batch (synchronized=True or `strategy.sync_batchnorm`), as named in errors."""
    synced = synchronized_layers(_keras.all_layers(model), strategy.sync_batchnorm)
    return [layer.name for layer in synced][:5]


def check_random_layers(model, strategy) -> None:
    """Refuse random layers whose draws depend on the batch they see when the global batch is
    cut into pieces (replicas, micro-batches): their results would differ from Keras's."""
    if strategy.replicas * strategy.microbatches == 1:
        return
    names = unsliceable_random_layers(model)
    if names:
        raise ValueError(
            f"Layers {names} draw random numbers that hyparflow cannot split over replicas and "
            "micro-batches as Keras draws them for the whole batch (Dropout and attention "
            "dropout can); apply such augmentation or noise in the input pipeline, or use "
            "one replica and num_microbatches=1."
        )


def check_sample_coupling(model, strategy, inputs) -> None:
    """Refuse a model whose outputs for a sample depend on the other samples of its batch
    where the global batch is cut into pieces (replicas, micro-batches): each piece would see
    other neighbours than Keras's whole batch (engine/keras_semantics/batch_coupling.py). Checked
    where the data are arrays and this process holds the weights."""
    if strategy.replicas * strategy.microbatches == 1:
        return
    change = sample_coupling(model, inputs)
    if change is not None and change > COUPLING_TOLERANCE:
        raise ValueError(
            f"{type(model).__name__} ({model.name!r}) mixes the samples of a batch: its "
            f"outputs for one sample move by {change:.1e} (relative) when another sample joins "
            "the batch, even in inference, so pieces of the global batch (replicas, "
            "micro-batches) cannot compute what Keras computes on the whole batch. Train it "
            "with replicas=1 and num_microbatches=1 (a pipeline of whole batches, or tensor "
            "parallelism), or on one process."
        )


def check_batchnorm(model, strategy) -> None:
    """Refuse global-batch BatchNormalization statistics where a pipeline cannot have them: a
    micro-batch is normalised before the later ones reach the layer."""
    synced = _global_batchnorm(model, strategy)
    if synced and strategy.microbatches > 1:
        raise ValueError(
            f"BatchNormalization layers {synced} normalise by the whole global batch "
            "(synchronized=True or sync_batchnorm=True), which micro-batches cannot see at once; "
            "use num_microbatches=1, or let each micro-batch normalise alone (synchronized=False, "
            "sync_batchnorm=False)."
        )


def check_router_losses(model, strategy) -> None:
    """Refuse micro-batches for keras_hub mixture blocks with a load-balancing loss unless in
    GPipe's order: its coefficients need the global batch's counts, which exist only once
    every micro-batch has been routed, before any backward (moe/router_tally.py); nor with
    `overlap_groups`, whose segments the tally does not follow. Replicas are exact."""
    if not strategy.sparse_experts or strategy.microbatches == 1:
        return
    weighted = [block.name for block in sparse_blocks(model) if router_loss_weight(block)]
    if not weighted:
        return
    if strategy.schedule != "gpipe" or strategy.overlap_groups > 1:
        raise ValueError(
            f"Mixture-of-experts blocks {weighted[:5]} add a router load-balancing loss, a "
            "product of means over the whole batch, which hyparflow computes exactly across "
            f"{strategy.microbatches} micro-batches only in GPipe's order (every forward before "
            "any backward) and without overlap_groups; use schedule='gpipe' (not "
            f"{strategy.schedule!r}) with overlap_groups=1, num_microbatches=1, or set the "
            "model's router loss coefficient to 0."
        )


def batchnorm_notice(model, strategy) -> str | None:
    """What rank 0 says when training starts if trainable BatchNormalization layers normalise
    by less than the global batch (each replica's or micro-batch's own statistics, hyparflow's
    default), which one process training the model with Keras would not do."""
    if strategy.replicas * strategy.microbatches == 1:
        return None
    layers = _keras.all_layers(model)
    synced = {id(layer) for layer in synchronized_layers(layers, strategy.sync_batchnorm)}
    local = [
        layer.name
        for layer in layers
        if isinstance(layer, keras.layers.BatchNormalization)
        and layer.trainable
        and id(layer) not in synced
    ]
    if not local:
        return None
    parts = "replica" if strategy.microbatches == 1 else "micro-batch"
    return (
        f"BatchNormalization layers {local[:5]}{' and more' if len(local) > 5 else ''} "
        f"normalise each {parts}'s share of the batch by its own statistics, so training differs "
        "from Keras in one process (docs/keras_parity.md). hf.Strategy(..., sync_batchnorm=True) "
        "normalises by the whole global batch (with one micro-batch)."
    )


def capacity_notice(model, strategy) -> str | None:
    """What rank 0 says when training starts if mixture experts drop the picks past their
    capacity (`Strategy(capacity_factor=...)`): the model trained is not Keras's."""
    blocks = [block.name for block in sparse_blocks(model)]
    if strategy.capacity_factor is None or not blocks:
        return None
    return (
        f"capacity_factor={strategy.capacity_factor}: the experts of mixture blocks {blocks[:5]} "
        "compute at most their capacity of each piece's picks and drop the rest, so training "
        "differs from Keras in one process (docs/moe.md); capacity_factor=None computes every "
        "pick."
    )


def training_notices(model, strategy) -> list[str]:
    """What rank 0 says when training starts about ways this layout trains differently from
    Keras in one process, by the user's choice."""
    found = (batchnorm_notice(model, strategy), capacity_notice(model, strategy))
    return [notice for notice in found if notice]


def layout_notice(model, strategy) -> str | None:
    """The line rank 0 prints (unless `verbose=0`) about what runs besides the layout the
    user named: keras_hub's mixture-of-experts blocks computed sparsely, their experts split
    over expert groups. None when there is nothing to say.

    Example:
        >>> from hyparflow import Strategy
        >>> layout_notice(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
        ...               Strategy("data")) is None
        True
    """
    blocks = sparse_blocks(model) if strategy.sparse_experts else []
    if not blocks:
        return None
    said = (
        f"hyparflow: {len(blocks)} mixture-of-experts blocks computed sparsely, each token "
        "through its top-k experts only (Strategy(sparse_experts=False): every expert, as Keras "
        "computes them)"
    )
    if strategy.experts > 1:
        said += (
            f"; their experts split over {strategy.experts} groups of replicas "
            f"(experts={strategy.experts}), tokens exchanged between them"
        )
    return said


def check_loss_reductions(model) -> None:
    """The engine weights each micro-batch's mean loss by its share of the global batch, which
    is exact for Keras's default "sum_over_batch_size" reduction."""
    compile_loss = _keras.compiled_loss(model)
    if compile_loss is None and own_steps(model):
        return  # the model's own step or loss may need no compiled loss (a GAN's)
    if compile_loss is None:
        raise ValueError("The model was compiled without a loss; pass loss=... to compile().")
    for loss_fn in tree.flatten(model.loss):
        reduction = getattr(loss_fn, "reduction", "sum_over_batch_size")
        if reduction not in ("sum_over_batch_size", "mean"):
            raise ValueError(
                f"Loss {getattr(loss_fn, 'name', loss_fn)!r} uses reduction {reduction!r}; "
                "multi-rank training needs reduction='sum_over_batch_size' (Keras's default)."
            )


def check_inputs(model, x, check_numerics: bool, *arrays) -> None:
    """Refuse inputs whose shapes the model cannot take, and NaN/Inf when asked to check."""
    if isinstance(x, np.ndarray | list | tuple | dict) and getattr(model, "inputs", None):
        given = model_input_list(model, x)
        if len(given) == len(model.inputs):
            for array, expected in zip(given, model.inputs, strict=True):
                shape, want = tuple(np.shape(array))[1:], tuple(expected.shape)[1:]
                if len(shape) != len(want) or any(
                    w is not None and w != s for s, w in zip(shape, want, strict=True)
                ):
                    raise ValueError(
                        f"Input of shape {tuple(np.shape(array))} does not fit the model input "
                        f"{expected.name!r} of shape {tuple(expected.shape)}; reshape the data "
                        "or build the model for it."
                    )
    if check_numerics:
        for array in tree.flatten([x, *arrays]):
            a = np.asarray(array) if array is not None else None
            if a is not None and a.dtype.kind == "f" and not np.all(np.isfinite(a)):
                raise ValueError(
                    f"The data holds NaN or Inf ({int(np.sum(~np.isfinite(a)))} values in an "
                    f"array of shape {a.shape}); clean it, or pass check_numerics=False."
                )


def check_tensor_parallel(model, strategy, comm_backend: str) -> None:
    """Refuse what tensor parallelism does not train exactly yet, before any rank starts."""
    if strategy.tensor == 1:
        return
    name = f"tensor={strategy.tensor}"
    if comm_backend != "mpi":
        raise ValueError(f"{name} sums gradients with hyparflow's MPI reduction; use comm='mpi'.")
    if strategy.overlap_groups > 1:
        raise ValueError(f"{name} does not overlap reductions by groups yet; use overlap_groups=1.")


def check_expert_parallel(model, strategy, comm_backend: str) -> None:
    """Refuse what expert parallelism (`experts` > 1) does not train exactly: a model without
    mixture blocks it splits, a block whose experts E does not divide,
    expert weights whose regularizer or constraint is not elementwise, another reduction than
    MPI's. (Clipping and L1/L2 regularizers sum their shards' parts over the group.)"""
    if strategy.experts == 1:
        return
    name = f"experts={strategy.experts}"
    blocks = sparse_blocks(model)
    if not blocks:
        raise ValueError(
            f"{name} splits keras_hub mixture-of-experts blocks (Mixtral, the Qwen mixtures, "
            "gpt-oss) over replicas, and this model has none; use experts=1."
        )
    uneven = [b.name for b in blocks if b.num_experts % strategy.experts]
    if uneven:
        counts = sorted({b.num_experts for b in blocks})
        raise ValueError(
            f"{name} does not divide the experts of blocks {uneven[:5]} (they have {counts}); "
            "pass an experts= that divides each block's number of experts."
        )
    if comm_backend != "mpi":
        raise ValueError(f"{name} sums gradients with hyparflow's MPI reduction; use comm='mpi'.")
    if strategy.overlap_groups > 1:
        raise ValueError(f"{name} does not overlap reductions by groups yet; use overlap_groups=1.")
    for variable in expert_weights(model):
        check_elementwise(variable, f"expert parallelism ({name})", "Use experts=1")


def check_sharded_optimizer(model, strategy, comm_backend: str) -> None:
    """Refuse what ZeRO-1 (`shard_optimizer=True`) cannot update slice by slice exactly: with
    one replica there is nothing to shard, and everything is accepted."""
    if not strategy.shard_optimizer or strategy.replicas == 1:
        return
    problem = zero_refusal(model.optimizer, strategy, comm_backend) or weights_refusal(
        model, strategy
    )
    if problem:
        raise ValueError(problem)


def _shards_optimizer(strategy) -> bool:
    return strategy.shard_optimizer and strategy.replicas > 1


def check_optimizer_unbuilt(model, strategy) -> None:
    """A new tensor-parallel or ZeRO trainer builds the optimizer for its shards or slices: it
    must be fresh."""
    splits = strategy.tensor > 1 or strategy.experts > 1
    if (splits or _shards_optimizer(strategy)) and getattr(model.optimizer, "built", False):
        name = (
            f"tensor={strategy.tensor}"
            if strategy.tensor > 1
            else f"experts={strategy.experts}"
            if strategy.experts > 1
            else strategy.sharding
        )
        raise ValueError(
            f"{name}: the model's optimizer was already built for whole variables; compile the "
            "model again (a fresh optimizer) before hf.fit builds it for the shards or slices."
        )


def check_layout(model, strategy, comm_backend: str) -> None:
    """Every refusal that depends on the layout, for the planner to leave out what `hf.fit`
    would refuse (each raises ValueError with its reason)."""
    check_standard_steps(model, strategy)
    check_random_layers(model, strategy)
    check_batchnorm(model, strategy)
    check_router_losses(model, strategy)
    check_tensor_parallel(model, strategy, comm_backend)
    check_expert_parallel(model, strategy, comm_backend)
    check_sharded_optimizer(model, strategy, comm_backend)
    check_optimizer_unbuilt(model, strategy)

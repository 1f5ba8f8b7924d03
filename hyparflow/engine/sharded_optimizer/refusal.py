"""Whether ZeRO-1 can shard an optimizer exactly: each element's update must read only its own
gradient and state (docs/zero.md); the check `model_checks` agrees on over every rank."""

from __future__ import annotations

from hyparflow import _keras
from hyparflow.engine.gradients.clipping import decide_clipping
from hyparflow.engine.gradients.update import inner_optimizer

# The optimizers whose update of each element depends only on that element's gradient, state
# and global scalars (step, learning rate): updating a slice of a flat vector is then exactly
# updating the whole variables. Adafactor (row/column factors), Lamb (per-variable trust
# ratio), Muon (orthogonalised matrices) are not, nor are custom optimizers we cannot read.
ELEMENTWISE_OPTIMIZERS = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "Nadam",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "Lion",
    "Ftrl",
)


def refusal(optimizer, strategy, comm_backend: str) -> str | None:
    """Why ZeRO-1 cannot shard `optimizer` under `strategy` exactly (None if it can): the
    update of each element must depend on that element alone (docs/zero.md).

    Example:
        >>> import keras
        >>> from hyparflow.strategy import Strategy
        >>> refusal(keras.optimizers.Lamb(), Strategy("data", shard_optimizer=True), "mpi")
        'shard_optimizer=True: Lamb does not update each element ...'
    """
    name, off = strategy.sharding, strategy.unsharded
    if comm_backend != "mpi":
        return f"{name} reduce-scatters gradients with MPI; use comm='mpi'."
    if strategy.overlap_groups > 1:
        return f"{name} reduces the flat gradient after the backward; use overlap_groups=1."
    inner = inner_optimizer(optimizer)
    kind = type(inner).__name__
    if kind not in ELEMENTWISE_OPTIMIZERS or not type(inner).__module__.startswith("keras"):
        return (
            f"{name}: {kind} does not update each element from its own gradient and state (or "
            f"hyparflow cannot tell), so a replica cannot update a slice alone; use one of "
            f"{', '.join(ELEMENTWISE_OPTIMIZERS)}, or {off}."
        )
    if decide_clipping(getattr(inner, "clipnorm", None), None).per_variable:
        return (
            f"{name}: the optimizer's clipnorm clips each variable by its own norm, which a "
            "slice cannot know; use global_clipnorm (clipped by the whole model's norm)."
        )
    if _keras.excludes_from_weight_decay(inner):
        return (
            f"{name}: exclude_from_weight_decay makes weight decay differ by variable, which a "
            f"flat slice cannot tell apart; drop the exclusion, or use {off}."
        )
    if getattr(inner, "use_ema", False):
        return (
            f"{name}: use_ema keeps a moving average of whole variables that the slices do not "
            f"hold; use use_ema=False, or {off}."
        )
    if (getattr(inner, "gradient_accumulation_steps", None) or 1) > 1:
        return (
            f"{name}: gradient_accumulation_steps accumulates whole gradients; accumulate by a "
            f"larger batch_size (or num_microbatches), or use {off}."
        )
    return None


def weights_refusal(model, strategy) -> str | None:
    """Why ZeRO-3 (`shard_weights`) cannot train `model` exactly (None if it can): a weight
    regularizer reads every weight whole at every step, which no rank holds; expert shards
    are kept whole by the ranks that compute them; the zero-bubble and interleaved schedules
    run stages whose calls do not gather."""
    if not strategy.shard_weights:
        return None
    pipelined = (strategy.partitions or 1) > 1
    if pipelined and strategy.schedule in ("zero_bubble", "interleaved"):
        return (
            f"shard_weights=True gathers each stage's weights for every call, which the "
            f"{strategy.schedule!r} schedule's stages do not run (a split backward, or chunks); "
            "use schedule='gpipe' or '1f1b', or shard_gradients=True."
        )
    if strategy.experts > 1:
        return (
            "shard_weights=True slices each replica's weights, but experts>1 keeps expert "
            "shards whole on the ranks that compute them; use shard_gradients=True with "
            "experts."
        )
    regularized = [v.path for v in model.trainable_variables if getattr(v, "regularizer", None)]
    if regularized:
        return (
            f"shard_weights=True keeps each weight as slices over the replicas, but "
            f"{regularized[:3]} have regularizers, which read the whole weight at every step; "
            "drop the regularizers (or use AdamW's weight_decay), or use shard_gradients=True."
        )
    return None

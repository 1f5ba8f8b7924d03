"""fit / evaluate / predict: validate, pick the strategy, run the engine, give weights back."""

from __future__ import annotations

from hyparflow.comm.world import size
from hyparflow.strategy import make_strategy


def _check_compiled(model) -> None:
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The model is not compiled; call model.compile(optimizer=..., loss=...) before hf.fit."
        )


def fit(
    model,
    x=None,
    y=None,
    *,
    batch_size=None,
    epochs=1,
    strategy="auto",
    num_partitions=None,
    num_replicas=None,
    num_microbatches=None,
    **fit_kwargs,
):
    """Train `model` like `model.fit`, spread over the MPI ranks by `strategy`.

    Accepts every keyword of `keras.Model.fit` (validation_data, callbacks, shuffle, verbose,
    sample_weight, initial_epoch, steps_per_epoch, ...) and returns a `keras.callbacks.History`.
    Without a launcher (world size 1) this is exactly `model.fit`.

    Example:
        >>> model.compile(optimizer="adam", loss="mse")
        >>> history = hf.fit(model, x, y, batch_size=64, epochs=3, strategy="data")
    """
    world_size = size()
    plan = make_strategy(strategy, num_partitions, num_replicas, num_microbatches).resolve(
        world_size
    )
    _check_compiled(model)
    if world_size == 1:
        # One rank, one partition, one replica: the embedded default is plain Keras.
        return model.fit(x, y, batch_size=batch_size, epochs=epochs, **fit_kwargs)
    raise NotImplementedError(
        f"multi-rank training ({plan.kind}, {plan.partitions} x {plan.replicas}) arrives with "
        "the engine; run without mpirun for now."
    )

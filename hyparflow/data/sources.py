"""What `hf.fit` reads its data with: arrays in a shared order, or Keras's own adapters.

Everything `model.fit` takes for `x` goes through Keras's `get_data_adapter` first, so its
checks, refusals and messages are Keras's (cardinality, `class_weight` with `sample_weight`,
`y` beside a Dataset, class weights for a generator), and so are its conversions (class weights
into sample weights, one sample-weight array broadcast over outputs, a batch size from
`steps_per_epoch`). Arrays are then read by `ArraySource`, where each rank gathers only its own
range of each batch; other data by `AdapterSource`. hyparflow's own readers (`hf.data.HDF5`)
batch themselves.
"""

from __future__ import annotations

import keras

from hyparflow import _keras
from hyparflow.data.adapters import AdapterSource, SharedOrder
from hyparflow.data.batches import ArraySource, check_divisible, unpack
from hyparflow.data.steps import EpochSteps


def make_source(
    x,
    y=None,
    sample_weight=None,
    *,
    batch_size=None,
    shuffle=False,
    seed=0,
    class_weight=None,
    steps=None,
):
    """A batch source for `x` as `model.fit(x, y, ...)` takes it, in an order every rank shares.

    Arrays are batched here (`batch_size`, default 32, or enough for `steps` batches); datasets,
    PyDatasets and generators come batched and must yield the same on every rank (no unseeded
    shuffling).
    """
    if hasattr(x, "as_source"):  # hyparflow's own readers (e.g. hf.data.HDF5) batch themselves
        _no_separate_targets(y, sample_weight, class_weight, type(x).__name__)
        return x.as_source(batch_size=batch_size or 32, shuffle=shuffle, seed=seed)
    if shuffle and isinstance(x, keras.utils.PyDataset) and x.num_batches is not None:
        x, shuffle = SharedOrder(x, seed), False  # Keras would shuffle with each rank's `random`
    adapter = _keras.data_adapter(
        x,
        y,
        sample_weight,
        batch_size=batch_size,
        steps=steps,
        class_weight=class_weight,
        shuffle=shuffle and not _keras.is_array_adapter_input(x, y, sample_weight),
    )
    if not _keras.is_array_adapter(adapter):
        return AdapterSource(adapter)
    x, y, sample_weight = unpack(_keras.adapter_arrays(adapter))
    return ArraySource(
        x, y, sample_weight, batch_size=adapter.batch_size, shuffle=shuffle, seed=seed
    )


def split_validation(data: tuple, fit_kwargs: dict) -> tuple:
    """(x, y, sample_weight) to train on and the validation data, from `validation_data` or
    Keras's `validation_split` (its last fraction of the arrays)."""
    validation_data = fit_kwargs.get("validation_data")
    split = fit_kwargs.get("validation_split", 0.0)
    if split and validation_data is None:
        return _keras.train_validation_split(data, validation_split=split)
    return data, validation_data


def fit_sources(data: tuple, validation_data, fit_kwargs: dict, *, batch_size, seed, strategy):
    """`hf.fit`'s training source (epochs cut as Keras 3 cuts them) and validation source
    (or None) for (x, y, sample_weight) and `model.fit`'s other data arguments; a batch that
    `strategy` cannot split is refused (None: the planner picks a layout that can)."""
    steps = fit_kwargs.get("steps_per_epoch")
    source = make_source(
        *data,
        batch_size=batch_size,
        shuffle=fit_kwargs.get("shuffle", True),
        seed=seed,
        class_weight=fit_kwargs.get("class_weight"),
        steps=steps,
    )
    if strategy is not None and hasattr(source, "batch_size"):  # arrays, hf.data.HDF5
        check_divisible(source.batch_size, strategy.replicas, strategy.microbatches)
    if validation_data is not None:
        batch = fit_kwargs.get("validation_batch_size") or batch_size
        validation_data = make_source(*unpack(validation_data), batch_size=batch)
    epochs = EpochSteps(source, steps, first_epoch=fit_kwargs.get("initial_epoch", 0))
    return epochs, validation_data


def nominal_batch_size(epochs: EpochSteps) -> int | None:
    """Samples in a full batch of `fit_sources`' training source, where known before reading."""
    source = epochs.source
    if isinstance(source, AdapterSource):
        return source.adapter.batch_size
    return source.batch_size


def input_arrays(source):
    """The arrays `x` of an array source (or of `fit_sources`' training source), whose shapes
    tell the model's input shapes; None for other data."""
    source = getattr(source, "source", source)
    return source.data[0] if isinstance(source, ArraySource) else None


def input_shapes(epochs: EpochSteps):
    """The shapes without the batch of the training arrays `x` (one array: its shape; a list:
    one each; a dict, keras_hub's kind: one each by name), as `measure_model` takes them;
    None for other data (the model's own)."""
    source = epochs.source
    x = source.data[0] if isinstance(source, ArraySource) else None
    if hasattr(x, "shape"):
        return tuple(x.shape[1:])
    if isinstance(x, list | tuple) and all(hasattr(a, "shape") for a in x):
        return [tuple(a.shape[1:]) for a in x]
    if isinstance(x, dict) and all(hasattr(a, "shape") for a in x.values()):
        return {name: tuple(a.shape[1:]) for name, a in x.items()}
    return None


def _no_separate_targets(y, sample_weight, class_weight, kind: str) -> None:
    if y is not None or sample_weight is not None or class_weight is not None:
        raise ValueError(
            f"With {kind} as x, pass no y, sample_weight or class_weight: the data yields them."
        )

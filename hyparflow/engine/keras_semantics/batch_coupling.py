"""Whether a model's outputs for one sample depend on the other samples of its batch.

hf.fit cuts each global batch into pieces (the replicas' shares, micro-batches) that run apart,
which equals Keras's step on the whole batch only where a sample's outputs depend on that sample
alone (BatchNormalization's training statistics aside: they have rules of their own). A model
that mixes the samples of its batch even in inference (keras_hub 0.32's XLNet: its first
sample's outputs move by 5e-3 when a second sample joins it, and data parallelism ended 2.5
(relative) off Keras) cannot be cut so. It is found before training by running the model in
inference on the data's first sample, alone and beside the second one. A model that takes its
batch statistics with `hf.global_mean` couples its samples on purpose, and the engine computes
those over the whole global batch (engine/keras_semantics/global_batch.py): it is not measured.
"""

from __future__ import annotations

import numpy as np
from keras import tree

from hyparflow.engine.keras_semantics.global_batch import BatchGroup, batch_group

# A change above this, relative to the outputs' magnitude, is the model's and not rounding:
# kernels that block rows by batch size differ by about one float32 unit (1e-7).
COUPLING_TOLERANCE = 1e-4


def sample_coupling(model, inputs) -> float | None:
    """The largest change of the first sample's outputs, relative to their largest magnitude,
    when the second sample joins its batch (inference); None where that cannot be run: no
    arrays of at least two samples, weights this process does not hold (hf.scope()), or a
    model whose layers call `hf.global_mean`."""
    leaves = tree.flatten(inputs) if inputs is not None else []
    if not leaves or any(len(leaf) < 2 for leaf in leaves):
        return None
    group = BatchGroup(comm=None, microbatches=1)  # notes the layers taking a global mean
    try:
        with batch_group(group):
            alone = _outputs(model, tree.map_structure(lambda a: np.asarray(a[:1]), inputs))
            paired = _outputs(model, tree.map_structure(lambda a: np.asarray(a[:2]), inputs))
    except Exception:  # noqa: BLE001 - weights not held here, a model that needs more rows
        return None
    if group.users:
        return None
    change = 0.0
    for one, two in zip(alone, paired, strict=True):
        scale = max(float(np.max(np.abs(one))), 1e-6)
        change = max(change, float(np.max(np.abs(two[:1] - one))) / scale)
    return change


def _outputs(model, inputs) -> list[np.ndarray]:
    outputs = model(inputs, training=False)
    return [np.asarray(o, dtype=np.float64) for o in tree.flatten(outputs)]

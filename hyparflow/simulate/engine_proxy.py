"""What the engine adds around a stage's layers, timed on a small stand-in model.

A stage call's launch, each layer's call overhead, summing micro-batches' gradients and the
optimizer's update per variable and per byte depend on the engine and the optimizer, not on the
model's size; `measure.measure_model` fits them on the model it times. A model too large to run
here (built under `hf.scope()`, or read from a file without its weights) gets them from
`measure_model` on a stand-in: `PROXY_LAYERS` Dense layers of `PROXY_WIDTH`, compiled with the
model's optimizer (its config, so its slots and arithmetic). Its per-layer fixed costs stay
with the layers (`by_layer.py` times each layer's own), so only the engine's fields are taken.
The stand-in is kept per optimizer config: ZeRO-1's host cost per byte is timed on it too.
"""

from __future__ import annotations

import functools
import json

import keras

PROXY_WIDTH = 512  # about a million parameters: per-byte costs dominate the fixed ones
PROXY_LAYERS = 4  # the stage fit splits it 2 and 4 ways
PROXY_BATCHES = (4, 16)
PROXY_REPEATS = (3, 3)


def engine_costs(optimizer):
    """The `EngineCosts` (loss left at zero) of a stage stepped by a copy of `optimizer`."""
    return _engine_costs(_config_text(optimizer))


def proxy_model(optimizer):
    """The compiled stand-in, stepped by a copy of `optimizer`."""
    return _proxy(_config_text(optimizer))


def _config_text(optimizer) -> str:
    return json.dumps(keras.optimizers.serialize(optimizer), sort_keys=True, default=repr)


@functools.cache
def _engine_costs(config: str):
    from hyparflow.simulate.measure import measure_model

    costs = measure_model(_proxy(config), PROXY_BATCHES, fit_batch_sizes=(), repeats=PROXY_REPEATS)
    return costs.engine


@functools.cache
def _proxy(config: str):
    inputs = keras.Input((PROXY_WIDTH,))
    x = inputs
    for _ in range(PROXY_LAYERS):
        x = keras.layers.Dense(PROXY_WIDTH)(x)
    model = keras.Model(inputs, x, name="engine_proxy")
    model.compile(keras.optimizers.deserialize(json.loads(config)), loss="mse")
    return model

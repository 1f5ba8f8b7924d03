"""Which of Keras's step methods a model overrides: its own `train_step`, `test_step` or
`compute_loss`, which data parallelism runs as the model's own step (engine/custom_step.py) and
the memory plan counts as one segment (its tape makes whole gradients)."""

from __future__ import annotations

import keras

OWN_STEPS = ("train_step", "test_step", "compute_loss")


def own_steps(model) -> list[str]:
    """The names among `OWN_STEPS` that `model`'s class overrides.

    Example:
        >>> class Guide(keras.Model):
        ...     def train_step(self, data):
        ...         return {}
        >>> own_steps(Guide()), own_steps(keras.Sequential())
        (['train_step'], [])
    """
    return [n for n in OWN_STEPS if getattr(type(model), n, None) is not getattr(keras.Model, n)]

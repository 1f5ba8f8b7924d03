"""Every compiled function of hyparflow: a `tf.function` without AutoGraph, as Keras builds its own.

Keras marks its train, test and predict steps `do_not_convert` and AutoGraph never converts
`keras` modules, so a model's code (a custom layer, an overridden `train_step`) runs as plain
Python when Keras traces it. hyparflow's step functions are straight-line TensorFlow; converting
them to AutoGraph's form re-parses their source and routes every call through
`converted_call`, which slows every first step (measured in docs/engine.md), and would convert
user code that Keras leaves alone. Tensor-valued control flow is written with `tf.cond`
and `tf.while_loop`; a Python `if` on a tensor fails at trace time instead of changing meaning.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf


def traced(function: Callable, **options) -> Callable:
    """`function` compiled by `tf.function(**options)` with AutoGraph off."""
    return tf.function(function, autograph=False, **options)

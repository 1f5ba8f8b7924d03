"""hyparflow compiles its functions as Keras does: `tf.function` with AutoGraph off, one way.

AutoGraph converts a function by re-writing its source into a generated module; hyparflow's
functions are plain TensorFlow and Keras converts none of its own (hyparflow/traced.py). A fit
that converted any function, or a module that calls `tf.function` itself, fails here.
"""

import ast
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
from hyparflow.traced import traced

PACKAGE = Path(hf.__file__).parent
GENERATED = "__autograph_generated_file"  # the prefix of AutoGraph's converted modules


def _calls_tf_function(node: ast.AST) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (
        isinstance(target, ast.Attribute)
        and target.attr == "function"
        and isinstance(target.value, ast.Name)
        and target.value.id == "tf"
    )


def _tf_function_uses(source: str) -> int:
    tree = ast.parse(source)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _calls_tf_function(n)]
    decorators = [
        d
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef)
        for d in n.decorator_list
        if _calls_tf_function(d)
    ]
    return len(calls) + len(decorators)


def test_only_traced_calls_tf_function():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "traced.py" and _tf_function_uses(path.read_text())
    ]
    assert offenders == []


def test_the_check_finds_both_forms():
    assert _tf_function_uses("f = tf.function(g)\n@tf.function\ndef h(): pass\n") == 2
    assert _tf_function_uses("f = traced(g)\n") == 0


def _converted_modules() -> set[str]:
    return {name for name in sys.modules if name.startswith(GENERATED)}


@pytest.mark.parametrize("strategy", ["data", hf.Strategy("model", partitions=1, microbatches=2)])
def test_a_fit_converts_no_function(strategy):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(keras.layers.Dense(5, activation="relu")(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = np.ones((20, 4), "float32"), np.zeros((20, 2), "float32")
    before = _converted_modules()
    # check_numerics: one process runs the engine (without an option it runs Keras's own fit)
    hf.fit(
        model,
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        validation_split=0.2,
        strategy=strategy,
        check_numerics=True,
    )
    assert _converted_modules() - before == set()


def test_a_tensor_condition_fails_at_trace_time():
    # with AutoGraph a Python `if` on a tensor would become a tf.cond; here it is refused
    def positive(x):
        return x if x > 0 else -x

    with pytest.raises(TypeError):
        traced(positive)(tf.constant(1.0))

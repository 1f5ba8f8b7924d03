"""`hyparflow/intercept.py` is the one way hyparflow replaces a call for a while: it puts back
exactly what was there, nests, re-enters, survives a failing replacement, and no other module
sets or deletes a layer's `call`, an optimizer's `apply` or Keras's random functions itself."""

import os
import re
import types

import keras
import pytest

from hyparflow.intercept import Replaced, instead, replaced_calls
from tests.support.sources import python_sources


def _dense():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    return layer


def test_the_class_call_shows_again_after_the_exit():
    layer = _dense()
    with replaced_calls([(layer, instead(lambda x: "replaced"))]):
        assert layer.call(None) == "replaced"
    assert "call" not in vars(layer)
    assert layer.call.__func__ is keras.layers.Dense.call


def test_a_call_the_user_set_is_wrapped_and_put_back():
    layer = _dense()
    users = lambda x: ("user's", x)  # noqa: E731 - a call set on the instance, as users do
    object.__setattr__(layer, "call", users)
    with replaced_calls([(layer, lambda previous: lambda x: ("wrapped", previous(x)))]):
        assert layer.call(1) == ("wrapped", ("user's", 1))
    assert vars(layer)["call"] is users


def test_holders_nest_and_the_same_holder_reenters():
    layer = _dense()
    outer = replaced_calls([(layer, lambda previous: lambda x: ["outer", previous(x)])])
    inner = replaced_calls([(layer, lambda previous: lambda x: ["inner", previous(x)])])
    object.__setattr__(layer, "call", lambda x: x)
    with outer, inner:
        with outer:  # entered again: nothing replaced twice
            assert layer.call(0) == ["inner", ["outer", 0]]
        assert layer.call(0) == ["inner", ["outer", 0]]  # kept until the outermost exit
    assert layer.call(0) == 0


def test_a_replacement_that_fails_leaves_everything_as_it_was():
    first, second = _dense(), _dense()

    def broken(previous):
        raise RuntimeError("cannot make it")

    calls = replaced_calls([(first, instead(print)), (second, broken)])
    with pytest.raises(RuntimeError, match="cannot make it"):
        calls.__enter__()
    assert "call" not in vars(first) and "call" not in vars(second)
    with replaced_calls([(first, instead(print))]):  # usable afterwards
        assert first.call is print


def test_a_module_function_is_replaced_and_put_back():
    module = types.ModuleType("random_ops")
    module.dropout = original = lambda x: x
    with Replaced([(module, "dropout", lambda previous: lambda x: previous(x) * 0)]):
        assert module.dropout(3) == 0
    assert module.dropout is original


# --- no other module intercepts by itself -----------------------------------------------------

# the methods hyparflow replaces for a while: a layer's call, an optimizer's apply, a loss
# Mean's update_state (per-output losses), BatchNormalization's moments (`_keras.py` names it)
_METHODS = r"(?:call|apply|update_state|_moments)"
_SETS_ITSELF = re.compile(
    rf"object\.__(?:set|del)attr__\([^,\n]+,\s*[\"']{_METHODS}[\"']"
    rf"|vars\([^)\n]*\)\.pop\(\s*[\"']{_METHODS}[\"']"
    rf"|\.{_METHODS}\s*=[^=]"
    r"|tf_random\.\w+\s*=[^=]"
)


def interceptions(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if _SETS_ITSELF.search(line)]


def test_the_scan_finds_each_way_of_intercepting_by_hand():
    planted = [
        'object.__setattr__(layer, "call", tapped)',
        "object.__delattr__(opt, 'apply')",
        'vars(block).pop("call", None)',
        "layer.call = wrapped",
        "metric.update_state = weighted",
        'object.__setattr__(norm, "_moments", moments)',
        "_keras.tf_random.dropout = sliced",
    ]
    assert interceptions("\n".join(planted)) == planted
    assert interceptions("if layer.call == other:\n    outputs = layer.call(x)") == []


def test_only_intercept_py_replaces_calls():
    found = {
        path: lines
        for path, text in python_sources("hyparflow").items()
        if path != os.path.join("hyparflow", "intercept.py")
        for lines in [interceptions(text)]
        if lines
    }
    assert found == {}

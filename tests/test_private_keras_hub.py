"""keras_hub's private attributes that hyparflow reads (`hyparflow/_keras_hub.py`): each exists on
the installed keras_hub's layers, and no other module spells one of them."""

import os

import pytest

from hyparflow import _keras, _keras_hub
from tests.support import hub_zoo
from tests.support.sources import python_sources

# the tiny models of tests/support/hub_zoo.py that hold every class of `_keras_hub.READ`
HOLDERS = ["Llama", "Mistral", "Qwen3Moe", "Bert", "GPT2", "Mixtral", "QwenMoe", "Qwen3_5Moe"]


@pytest.fixture(scope="module")
def layers_by_class():
    found = {}
    for family in HOLDERS:
        for layer in _keras.all_layers(hub_zoo.backbone(family)):
            found.setdefault(type(layer).__name__, []).append(layer)
    return found


@pytest.mark.parametrize("kind", sorted(_keras_hub.READ))
def test_the_installed_keras_hub_has_each_attribute_read(layers_by_class, kind):
    instances = layers_by_class.get(kind)
    assert instances, f"no {kind} in {HOLDERS}: name a family that holds one"
    for layer in instances:
        missing = [name for name in _keras_hub.READ[kind] if not hasattr(layer, name)]
        assert missing == [], f"{kind} has no {missing} in this keras_hub"


def _names() -> set[str]:
    values = [v for k, v in vars(_keras_hub).items() if k.isupper() and k != "READ"]
    return {n for v in values for n in (v if isinstance(v, tuple) else (v,))}


def test_no_other_module_spells_a_private_keras_hub_name():
    spelled = [
        f"{path}: {n}"
        for path, text in python_sources("hyparflow").items()
        if path != os.path.join("hyparflow", "_keras_hub.py")
        for n in _names()
        if f'"{n}"' in text
    ]
    assert spelled == []
    assert "_query_dense" in _names() and "_router_gate" in _names()  # the scan looks for them

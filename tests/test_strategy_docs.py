"""Every hf.Strategy field is documented in its docstring, one entry each, with its default."""

import dataclasses
import re

from hyparflow.strategy import Strategy


def test_every_field_has_one_entry_with_its_default():
    doc = Strategy.__doc__
    entries = dict(re.findall(r"^\s*- `(\w+)` \(([^)]*)\):", doc, flags=re.MULTILINE))
    fields = {f.name: f.default for f in dataclasses.fields(Strategy)}
    assert set(entries) == set(fields), "fields without an entry, or entries without a field"
    for name, default in fields.items():
        assert entries[name] == repr(default).replace("'", '"'), f"{name}: default differs"

"""Public names of a package imported on first use (PEP 562), so light commands skip TensorFlow."""

from __future__ import annotations

import importlib
import sys


def lazy_names(package: str, where: dict[str, str | None]):
    """`__getattr__` and `__dir__` for `package`, whose public `name` lives in module
    `where[name]` (None: `name` is a subpackage). A name is imported once, then cached in the
    package, so `from hyparflow.partitioner import balance` reads no heavy sibling module."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = where[name]
        if module is None:
            return importlib.import_module(f"{package}.{name}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted({*where, *vars(sys.modules[package])})

    return __getattr__, __dir__

"""keras_hub's mixture blocks dispatched sparsely inside Keras's own fit, evaluate and predict.

In one process `hf.fit` is `model.fit`, whose keras_hub mixture blocks compute every expert on
every token (docs/moe.md). While `sparse_in_keras` is entered they run `SparseDispatch`'s calls
instead: the same sum of the same non-zero terms and, the whole batch being one piece,
keras_hub's own load-balancing loss. Keras keeps the step functions it compiles: those compiled
outside (around the dense calls) are dropped on entry, those compiled inside are kept for the
next entry, so a second `hf.fit` traces nothing again (a `model.fit` of the user's reuses them
too: the same results to float rounding). A model compiled for XLA (`jit_compile`, Keras's
default where a GPU is seen) stays dense: the dispatch's data-dependent shapes do not compile.
"""

from __future__ import annotations

import contextlib

from hyparflow._keras import COMPILED_STEPS
from hyparflow.moe.keras_hub_blocks import SparseDispatch

_SPARSE_STEPS = "_hyparflow_sparse_steps"  # ids of the steps compiled around the sparse calls


@contextlib.contextmanager
def sparse_in_keras(model, sparse: bool = True):
    """Keras's own calls of `model` dispatch its keras_hub mixture blocks sparsely while
    entered (`sparse` False, or a model compiled for XLA: nothing changes)."""
    chosen = model if sparse and not model.jit_compile else None
    with SparseDispatch(chosen) as dispatch:
        if dispatch.blocks:
            kept = getattr(model, _SPARSE_STEPS, set())
            for name in COMPILED_STEPS:  # compiled around the dense calls: Keras traces again
                if getattr(model, name) is not None and id(getattr(model, name)) not in kept:
                    setattr(model, name, None)
        try:
            yield dispatch
        finally:
            if dispatch.blocks:
                steps = {id(getattr(model, name)) for name in COMPILED_STEPS}
                object.__setattr__(model, _SPARSE_STEPS, steps - {id(None)})

"""Keras metric states summed across replicas, turned into logs every rank agrees on."""

from __future__ import annotations

import numpy as np


def reduced_results(model, comm, results=None) -> dict:
    """`model.get_metrics_result()` as if all replicas on `comm` had fed one metric set.

    Keras metric states (totals, counts, confusion counts) add up across disjoint data, so the
    states are summed over `comm`, read out, and the local states put back untouched.
    `results` replaces `model.get_metrics_result` (the trainer passes a compiled one).
    """
    results = results or model.get_metrics_result
    variables = list(model.metrics_variables)
    if comm.Get_size() > 1 and variables:
        local = [np.array(v.numpy()) for v in variables]
        flat = np.concatenate([a.astype(np.float64).ravel() for a in local])
        summed = np.empty_like(flat)
        comm.Allreduce(flat, summed)
        offset = 0
        for variable, array in zip(variables, local):
            part = summed[offset : offset + array.size].reshape(array.shape)
            variable.assign(part.astype(array.dtype))
            offset += array.size
        try:
            return to_floats(results())
        finally:
            for variable, array in zip(variables, local):
                variable.assign(array)
    return to_floats(results())


def to_floats(logs: dict) -> dict:
    """Scalar tensors to Python floats, so logs pickle cheaply and compare exactly."""
    return {k: float(np.asarray(v)) if np.ndim(v) == 0 else np.asarray(v) for k, v in logs.items()}

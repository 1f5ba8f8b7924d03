"""Scaling model: predict hyparflow's step time for P partitions x R replicas on N nodes."""

from hyparflow.simulate.costs import Affine, EngineCosts, LayerCost, ModelCosts
from hyparflow.simulate.network import Link, Network
from hyparflow.simulate.placement import Layout
from hyparflow.simulate.predict import Machine, Prediction, efficiency, predict, speedup

__all__ = [
    "Affine",
    "EngineCosts",
    "LayerCost",
    "Layout",
    "Link",
    "Machine",
    "ModelCosts",
    "Network",
    "Prediction",
    "efficiency",
    "predict",
    "speedup",
]

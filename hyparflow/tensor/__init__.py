"""Tensor parallelism: single layers split over neighbouring ranks, Megatron-LM style.

`tensor_layout(model, T)` finds which layers split and how (`rules.py`, arithmetic in
`layout.py`); `TensorShards` holds a rank's shards and runs the split layers' calls
(`shards.py`) with Megatron's conjugate communication (`collectives.py`). docs/tensor.md.
"""

from hyparflow.tensor.rules import tensor_layout
from hyparflow.tensor.shards import TensorShards
from hyparflow.tensor.splits import TensorLayout

__all__ = ["TensorLayout", "TensorShards", "tensor_layout"]

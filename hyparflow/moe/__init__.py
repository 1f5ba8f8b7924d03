"""Mixture-of-experts layers: each token computed only by the experts its router picks."""

from hyparflow.moe.keras_hub_blocks import SparseDispatch, sparse_blocks

__all__ = ["SparseDispatch", "sparse_blocks"]

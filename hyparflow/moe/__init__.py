"""Mixture-of-experts layers: each token computed only by the experts its router picks, and the
router's load-balancing loss of the whole global batch."""

from hyparflow.moe.keras_hub_blocks import SparseDispatch, router_loss_weight, sparse_blocks

__all__ = ["SparseDispatch", "router_loss_weight", "sparse_blocks"]

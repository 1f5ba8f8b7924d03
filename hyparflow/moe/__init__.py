"""Mixture-of-experts layers: each token computed only by the experts its router picks, the
router's load-balancing loss of the whole global batch, and the experts split over replicas
(expert parallelism)."""

from hyparflow.moe.expert_shards import ExpertShards, expert_groups, expert_weights
from hyparflow.moe.keras_hub_blocks import SparseDispatch, router_loss_weight, sparse_blocks
from hyparflow.moe.router_tally import RouterTally

__all__ = [
    "ExpertShards",
    "RouterTally",
    "SparseDispatch",
    "expert_groups",
    "expert_weights",
    "router_loss_weight",
    "sparse_blocks",
]

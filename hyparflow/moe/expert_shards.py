"""This rank's share of the mixture blocks' experts (expert parallelism), and the groups of
replicas that split them.

With `experts=E`, each run of E consecutive replicas of a stage (an expert group) splits every
block's experts: the rank at position `i` of its group holds experts `[i * n/E, (i+1) * n/E)`
of each kernel, as one shard variable with the kernel's path (so optimizer slots name it as
Keras does), trains only those, and sums their gradients with the ranks at position `i` of the
other groups. As with tensor shards, the user's model keeps its whole kernels: while
`active()` the banks hold the shards, `store()` gathers them back and `load()` cuts them anew.
"""

from __future__ import annotations

import contextlib

from hyparflow.comm.failure import watched
from hyparflow.comm.topology import expert_group
from hyparflow.moe.keras_hub_blocks import policy_of, sparse_blocks
from hyparflow.tensor.shards import Shard, swap_variable


def expert_groups(stage_comm, experts: int) -> tuple:
    """(this rank's expert group, the ranks at its position in every group): two splits of
    `stage_comm` (its rank is the replica), collective over it."""
    group, position = expert_group(stage_comm.Get_rank(), experts)
    within = watched(stage_comm.Split(color=group, key=position))
    across = watched(stage_comm.Split(color=position, key=group))
    return within, across


def _banks_and_kernels(blocks) -> list:
    """(expert bank, one of its expert kernels) of each block of `blocks`, in policy order."""
    found = []
    for block in blocks:
        policy = policy_of(block)
        bank = getattr(block, policy.bank)
        found += [(bank, getattr(bank, name)) for name in policy.kernels]
    return found


def expert_weights(model) -> list:
    """The whole expert kernels of `model`'s mixture blocks that sparse dispatch computes."""
    return [kernel for _, kernel in _banks_and_kernels(sparse_blocks(model))]


class ExpertShards:
    """The expert shards of the mixture blocks in `graphs` (the rank's stages) held by position
    `group.Get_rank()` of the expert group `group`; `across` links the ranks at that position
    in every group (their gradients are summed)."""

    def __init__(self, graphs: list, group, across):
        self.group, self.across = group, across
        self.parts, self.index = parts, index = group.Get_size(), group.Get_rank()
        blocks = {id(b): b for graph in graphs for b in sparse_blocks(graph)}
        self.shards = [
            Shard(bank, kernel, 0, parts, index)
            for bank, kernel in _banks_and_kernels(blocks.values())
        ]
        self._depth = 0

    @property
    def variables(self) -> list:
        return [s.shard for s in self.shards]

    def load(self) -> None:
        """Cut the model's whole expert kernels into this rank's shards."""
        for s in self.shards:
            s.load()

    def store(self, guard) -> None:
        """Gather every rank's shards of its group into the model's whole kernels (collective
        over the group; `guard(operation)` watches the wait)."""
        for s in self.shards:
            s.store(self.group, guard, "gather expert shards")

    @contextlib.contextmanager
    def active(self):
        """The expert banks hold this rank's shards (re-entrant)."""
        self._depth += 1
        swapped = []
        try:
            if self._depth == 1:
                for s in self.shards:
                    swap_variable(s.layer, s.attribute, s.whole, s.shard)
                    swapped.append(s)
            yield
        finally:
            self._depth -= 1
            for s in reversed(swapped):
                swap_variable(s.layer, s.attribute, s.shard, s.whole)

    def free(self) -> None:
        for comm in (self.group, self.across):
            comm.Free()

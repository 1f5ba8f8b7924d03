"""One optimizer's slices of the variables a model's own step applies it to (ZeRO-1/2/3).

A model's own step may apply several optimizers, each to its own variables (a GAN's generator
and discriminator optimizers), or its compiled optimizer to part of the model. Each such
optimizer gets slices of its own: the variables it is applied to, flattened per dtype and cut
over the replicas as `ShardedUpdate` cuts a stage (`sliced_segments`), its state built for
this replica's slices alone. The variables stay the truth between its updates: each update
loads the slices from them (`load_slices`) and all-gathers the new slices back into them
(`in_step.SlicedApply`). Checkpoints and the fit's end read its state through a
`SliceCheckpoint` over this object, as they read the compiled optimizer's.
"""

from __future__ import annotations

from typing import Any, Protocol

from hyparflow.engine.sharded_optimizer.sharded_update import load_slices, sliced_segments


class SliceSet(Protocol):
    """One optimizer's slices of some variables, as `in_step.SlicedApply` steps them and
    `checkpoint.SliceCheckpoint` saves them: a stage's `ShardedUpdate` (its compiled
    optimizer) or an `OptimizerSlices` (any optimizer of a model's own step)."""

    optimizer: Any  # the Keras optimizer whose state is built for the slices
    variables: list  # the variables sliced, in the groups' positions
    groups: list  # per dtype (and segment), this replica's slice and its layout
    table_prefixes: list  # (slot name prefix, table) of the tables kept whole

    def load_slices(self) -> None: ...

    def build_optimizer(self) -> None: ...


class OptimizerSlices:
    """`optimizer`'s slices of `variables` (the variables a step applies it to, in the order it
    first did), this replica's of `comm`'s; the slice variables' names begin with `prefix`
    (one per optimizer, so that each one's slot names are its own).

    Example:
        slices = OptimizerSlices(optimizer, head_variables, comm, "hyparflow_zero_adam")
        slices.build_optimizer()  # its slots: 1/R of the head's, per replica
    """

    def __init__(self, optimizer, variables: list, comm, prefix: str):
        self.optimizer = optimizer
        self.variables = list(variables)
        positions = list(range(len(self.variables)))
        self.groups = sliced_segments(self.variables, positions, None, comm, prefix)[0]
        self.table_prefixes: list = []  # every variable is sliced: no table is kept whole

    def load_slices(self) -> None:
        """The slices take their elements of the variables' current values."""
        load_slices(self.groups, self.variables)

    def build_optimizer(self) -> None:
        """Build the optimizer for this replica's slices; one built before (for whole
        variables, or for other slices) cannot step them."""
        if self.optimizer.built:
            raise ValueError(
                f"{type(self.optimizer).__name__} ({self.optimizer.name}) was built before the "
                "model's own step applied it under sharding (for whole variables, or by a "
                "resumed checkpoint for other slices); hf.fit builds it for this replica's "
                "slices of the variables the step applies it to. Give the model a fresh "
                "optimizer, or train with the optimizer state unsharded."
            )
        self.optimizer.build([group.variable for group in self.groups])

"""The narrow view of one rank's training state that checkpoints save and restore."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class StageState(Protocol):
    """What `save` reads and `restore` writes; the engine provides it (`Trainer.stage_state`).

    `save` is collective: every rank calls it at the same point, and `guard(operation)` watches
    each of its blocking MPI waits. Only the first replica of each stage writes a file (one per
    tensor rank under tensor parallelism; every replica under ZeRO-1, its optimizer slices).
    """

    model: Any  # the user's model: every rank holds all of its weights (hf.scope: its own)
    variables: list  # the trainable variables this stage's optimizer updates
    world: Any  # the communicator of every rank
    stage: int
    replica: int
    num_stages: int
    num_replicas: int
    is_last: bool  # the last stage holds the metric states
    step: int  # optimizer steps taken (`restore` sets it)
    seed: int  # the current fit's shared shuffle seed
    pending_metric_states: list  # metric sums of a resumed epoch (`restore` sets them)
    shard: int  # this rank's tensor shard (0 without tensor parallelism)
    num_shards: int
    split: dict  # path -> `state.Piece` of each variable this rank holds a part of
    writes_pieces: bool  # this rank writes its pieces (replica 0; the first expert group)
    shard_variables: dict  # path -> the shard variable holding this rank's part of it
    # None, or (ZeRO-1) this replica's slice of the optimizer state: `optimizer_state(model,
    # split, shard, replica)` gives its entries, `restore_optimizer(model, state, split)` loads
    # them; then every replica writes a file. Under ZeRO-3 also its slices of the weights the
    # slices hold now: `weights_state(model, split, shard)`, and `holds_slices(variable)` says
    # which (they are not read whole)
    optimizer_shard: Any

    def guard(self, operation: str) -> AbstractContextManager: ...

    def owned_weight_indices(self) -> list[int]:
        """Indices in `model.weights` whose latest value this stage holds."""
        ...

    def runs_layer(self, layer) -> bool:
        """Whether this stage calls `layer` (so its random seed state advances here)."""
        ...

    def summed_metric_states(self) -> list:
        """The last stage's metric states summed over its replicas ([] elsewhere; collective)."""
        ...

"""Which of Keras's gradient clippings a stage's update does itself, over which gradients: one
decision, pure and table-tested (`tests/test_clipping.py`).

Keras clips inside `optimizer.apply`: `clipnorm` scales each variable's gradient by that
variable's own norm, `global_clipnorm` all of them by their joint norm. Spread over ranks, a
rank holds neither every gradient of the model (pipeline stages, tensor and expert shards) nor,
for a split variable, all of its gradient, so the update computes those norms over the ranks
that hold the parts and clips by them (`Update`, `SegmentUpdate`, `ShardedUpdate`). An
update in parts (by segment, by group) cannot start before such a norm is known.
"""

from __future__ import annotations

from dataclasses import dataclass

STAGE = "stage"  # this stage's gradients are the whole model's
RANKS = "ranks"  # summed over the pipeline and the ranks holding shards


@dataclass(frozen=True)
class Clipping:
    """A stage's clipping. `global_norm_over`: None without `global_clipnorm`, else whose
    gradients make Keras's global norm (`STAGE` or `RANKS`). `per_variable`: Keras's
    `clipnorm`. `shards_by_whole_variable`: `clipnorm` meets tensor or expert shards, each
    clipped by its whole variable's norm before the optimizer runs (`ShardClipping`)."""

    global_norm_over: str | None = None
    per_variable: bool = False
    shards_by_whole_variable: bool = False

    @property
    def by_global_norm(self) -> bool:
        return self.global_norm_over is not None

    @property
    def needs_every_gradient(self) -> bool:
        """Whether a norm over several variables' gradients comes first, so that no part of
        the update may run before the backward has made them all."""
        return self.by_global_norm or self.shards_by_whole_variable


def decide_clipping(
    clipnorm, global_clipnorm, *, partitioned: bool = False, split_variables: bool = False
) -> Clipping:
    """The clipping of a stage whose optimizer has `clipnorm`/`global_clipnorm` (None or 0:
    unset), in a model cut into pipeline stages (`partitioned`) or holding tensor or expert
    shards (`split_variables`).

    Example:
        >>> decide_clipping(None, 1.0, partitioned=True)
        Clipping(global_norm_over='ranks', per_variable=False, shards_by_whole_variable=False)
        >>> decide_clipping(0.5, None, split_variables=True).needs_every_gradient
        True
        >>> decide_clipping(0.5, None).needs_every_gradient  # Keras clips each variable alone
        False
    """
    over = None
    if global_clipnorm:
        over = RANKS if partitioned or split_variables else STAGE
    return Clipping(
        global_norm_over=over,
        per_variable=bool(clipnorm),
        shards_by_whole_variable=bool(clipnorm) and split_variables,
    )

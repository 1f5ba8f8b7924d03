"""What a tensor layout is: each split layer's role and axes, and what stays whole."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import keras
import numpy as np

from hyparflow.partitioner.graph import numpy_dtype
from hyparflow.tensor.layout import Indivisible, axes_of, shard_bytes

# Megatron-LM's roles: a column layer splits its output units, a row layer its input units
# (its partial sums are added after), a vocabulary layer its embedding table's rows.
COLUMN, ROW, VOCAB = "column", "row", "vocab"


@dataclass
class LayerSplit:
    """One layer's share of the layout: its `role` and the split `axes` of its variables."""

    layer: object
    role: str  # COLUMN, ROW or VOCAB
    axes: dict = field(default_factory=dict)  # id(variable) -> (variable, axis)
    reason: str = ""
    input_copied: bool = False  # a column whose input an enclosing attention copied already

    def axis_of(self, variable) -> int | None:
        entry = self.axes.get(id(variable))
        return None if entry is None else entry[1]


@dataclass
class TensorLayout:
    """The layout of a model (or one pipeline stage) over `parts` tensor ranks."""

    parts: int
    splits: list = field(default_factory=list)  # LayerSplit, in the model's layer order
    dropouts: list = field(default_factory=list)  # (Dropout layer, axis of the split features)
    # (attention layer, names of its input arguments): each distinct input is copied to the
    # shards once (one allreduce of its gradient), not once per projection (Megatron's fused QKV)
    copies: list = field(default_factory=list)
    # layers whose whole weights act on this rank's heads only (a norm of each query or key
    # head): each rank's gradient is a part of the whole's, summed over the tensor ranks
    summed: list = field(default_factory=list)
    replicated: list = field(default_factory=list)  # "layer: why it stays whole"
    # layers a rule would split but keeps whole on every tensor rank (`keep_whole`)
    kept_whole: list = field(default_factory=list)
    variables: list = field(default_factory=list)  # every trainable variable of the model

    def keep_whole(self, name: str, layers: list, why: str) -> None:
        """Keep `layers` (a rule's group, `name` in the table) whole on every tensor rank."""
        self.kept_whole += layers
        self.replicated.append(f"{name}: kept whole on every tensor rank, as {why}")

    @contextlib.contextmanager
    def all_or_none(self, name: str, layers: list):
        """The splits a rule adds inside the context, or none: when one of the group's
        dimensions does not divide (`Indivisible`), what it added is taken back and `layers`
        stay whole together. Half a group cannot be split: a row layer needs its column's split
        output, and a rank's query heads their own keys and values."""
        marks = [(items, len(items)) for items in (self.splits, self.dropouts, self.copies)]
        try:
            yield
        except Indivisible as error:
            for items, mark in marks:
                del items[mark:]
            self.keep_whole(name, layers, error.reason)

    def split_of(self, variable) -> int | None:
        """The split axis of `variable`, or None when every rank holds all of it."""
        for split in self.splits:
            axis = split.axis_of(variable)
            if axis is not None:
                return axis
        return None

    def layout_map(self) -> dict:
        """`{variable path: axes}` for every split variable, in LayoutMap's convention: a
        starting point for a `tensor_layout` override."""
        return {
            v.path: axes_of(axis, len(v.shape))
            for split in self.splits
            for v, axis in split.axes.values()
        }

    def bytes_per_rank(self) -> tuple[int, int]:
        """(bytes of split variables one rank holds, bytes of replicated ones)."""
        axes = {key: axis for s in self.splits for key, (_, axis) in s.axes.items()}
        split = replicated = 0
        for v in self.variables:
            axis = axes.get(id(v))
            size = shard_bytes(v.shape, axis, self.parts, _itemsize(v))
            if axis is None:
                replicated += size
            else:
                split += size
        return split, replicated

    def to_dict(self) -> dict:
        """The layout as JSON-ready data: split variables (LayoutMap form), what stays whole,
        and the bytes one rank holds."""
        split, replicated = self.bytes_per_rank()
        return {
            "tensor": self.parts,
            "layout_map": {path: list(axes) for path, axes in self.layout_map().items()},
            "replicated": list(self.replicated),
            "split_bytes_per_rank": split,
            "replicated_bytes": replicated,
        }

    def summary(self) -> str:
        """Which layers split which way, what stays whole and why, and the bytes per rank."""
        lines = [f"Tensor layout over {self.parts} ranks:"]
        for s in self.splits:
            shapes = ", ".join(f"{v.path} {tuple(v.shape)} axis {a}" for v, a in s.axes.values())
            lines.append(f"  {s.layer.name:<28} {s.role:<7} {shapes}  ({s.reason})")
        for line in self.replicated:
            lines.append(f"  replicated: {line}")
        split, replicated = self.bytes_per_rank()
        lines.append(
            f"  per rank: {split:,} bytes of split weights (1/{self.parts} each) + "
            f"{replicated:,} replicated"
        )
        return "\n".join(lines)


def _itemsize(variable) -> int:
    return np.dtype(numpy_dtype(keras.backend.standardize_dtype(variable.dtype))).itemsize

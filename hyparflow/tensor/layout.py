"""Which dimension of each variable is split over the tensor ranks: pure rules and checks.

A layout is written in the convention of Keras's `keras.distribution.LayoutMap`: a variable
path maps to one entry per dimension, "tensor" on the split one and None elsewhere (all None,
or no entry: replicated). This module knows nothing of Keras or MPI, so the arithmetic of
shards, the error messages and the bytes per rank are unit-tested in milliseconds.
"""

from __future__ import annotations

import math
import re

from hyparflow.strategy import divisors

TENSOR = "tensor"


def split_axis(axes, path: str = "") -> int | None:
    """The dimension `axes` splits (the one named "tensor"), or None when it splits none."""
    axes = tuple(axes)
    named = [i for i, a in enumerate(axes) if a == TENSOR]
    unknown = [a for a in axes if a not in (None, TENSOR)]
    if unknown:
        raise ValueError(
            f"tensor_layout entry for {path!r} names {unknown!r}; use None for a replicated "
            f'dimension and "tensor" for the one split over the tensor ranks.'
        )
    if len(named) > 1:
        raise ValueError(
            f"tensor_layout entry for {path!r} splits {len(named)} dimensions; split one."
        )
    return named[0] if named else None


def axes_of(axis: int | None, rank: int) -> tuple:
    """The LayoutMap tuple that splits dimension `axis` of a rank-`rank` variable."""
    return tuple(TENSOR if i == axis else None for i in range(rank))


def bounds(size: int, parts: int, shard: int) -> tuple[int, int]:
    """`[begin, end)` of shard `shard` when a dimension of `size` is cut into `parts` equal
    pieces (callers check divisibility first)."""
    step = size // parts
    return shard * step, (shard + 1) * step


class Indivisible(ValueError):
    """A layer dimension that the tensor ranks do not divide. The automatic rules catch it and
    keep the layer (with its partners) whole on every tensor rank, `reason` in the layout's
    table; where a `tensor_layout` names the layer, the user asked for the split: an error."""

    def __init__(self, layer: str, what: str, size: int, parts: int):
        self.layer, self._fields = layer, (layer, what, size, parts)
        fits = f"tensor values that split it: {divisors(size)}"
        undivided = f"{size} {what} of {layer!r} are not a multiple of tensor={parts}"
        self.reason = f"the {undivided} ({fits})"
        super().__init__(
            f"tensor_layout splits layer {layer!r}, but its {size} {what} are not a multiple of "
            f"tensor={parts}; {fits}. Drop its entries to keep it whole on every tensor rank."
        )

    def __reduce__(self):  # picklable, though its message is not its one argument
        return Indivisible, self._fields


def check_divides(layer: str, what: str, size: int, parts: int) -> None:
    """Raise `Indivisible` when `parts` tensor ranks cannot split a dimension of `size` evenly."""
    if size % parts:
        raise Indivisible(layer, what, size, parts)


def lookup(layout_map: dict, path: str):
    """The entry of `layout_map` for variable `path`, found as Keras's LayoutMap finds it: the
    exact path first, else the one regex that `re.search`es it (None: no entry). Two matching
    regexes are an error."""
    if path in layout_map:
        return layout_map[path]
    matches = [key for key in layout_map if re.search(key, path)]
    if len(matches) > 1:
        raise ValueError(
            f"Variable {path!r} matches several tensor_layout keys {matches}; make them "
            "exclusive, as keras.distribution.LayoutMap requires."
        )
    return layout_map[matches[0]] if matches else None


def shard_bytes(shape, axis: int | None, parts: int, itemsize: int) -> int:
    """Bytes one rank holds of a variable of `shape` split on `axis` (None: replicated)."""
    elements = math.prod(int(d) for d in shape)
    if axis is not None:
        elements //= parts
    return elements * itemsize

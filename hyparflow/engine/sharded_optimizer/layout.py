"""Where each replica's slice of a stage's flattened variables lies under ZeRO-1 (pure arithmetic).

A stage's variables of one dtype, flattened in variable order and concatenated, form one
vector of `length` elements, padded with zeros to a multiple of the replica count R; replica
r owns the contiguous slice [r·n/R, (r+1)·n/R) of the padded vector (n = `padded`), holds
the optimizer state of that slice only, and updates it (Rajbhandari et al. 2020, ZeRO stage 1).
No TensorFlow and no MPI here, so this is unit-tested in milliseconds (tests/test_zero.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Extent:
    """The elements [start, stop) of flattened variable `variable` (its index in the layout),
    found at `offset` in the slice that holds them."""

    variable: int
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class SliceLayout:
    """The flat vector of variables of `sizes` elements each, cut into `parts` equal slices.

    Example:
        >>> layout = SliceLayout([6, 3], parts=2)     # 9 elements, padded to 10
        >>> layout.bounds(1), layout.slice_size, layout.padding(1)
        ((5, 10), 5, 1)
        >>> layout.extents(1)  # doctest: +NORMALIZE_WHITESPACE
        [Extent(variable=0, start=5, stop=6, offset=0),
         Extent(variable=1, start=0, stop=3, offset=1)]
    """

    def __init__(self, sizes: list[int], parts: int):
        if parts < 1:
            raise ValueError(f"SliceLayout needs at least one part, got {parts}")
        self.sizes = [int(s) for s in sizes]
        self.parts = parts
        self.offsets = []
        total = 0
        for size in self.sizes:
            self.offsets.append(total)
            total += size
        self.length = total
        self.slice_size = -(-total // parts)  # ceil: the last slices carry the padding
        self.padded = self.slice_size * parts

    def bounds(self, part: int) -> tuple[int, int]:
        """[start, stop) of slice `part` in the padded flat vector."""
        return part * self.slice_size, (part + 1) * self.slice_size

    def extents(self, part: int) -> list[Extent]:
        """The extents of variables that slice `part` holds, in order (padding not included)."""
        start, stop = self.bounds(part)
        found = []
        for index, (offset, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                found.append(Extent(index, low - offset, high - offset, low - start))
        return found

    def padding(self, part: int) -> int:
        """Zeros at the end of slice `part` (beyond the last variable)."""
        return self.slice_size - sum(p.size for p in self.extents(part))

    def element_ranges(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(variable, its first element, count) of the variables' elements in the flat
        vector's [start, stop), in order; the padding beyond the variables yields nothing.

        Example:
            >>> SliceLayout([6, 3], parts=2).element_ranges(4, 8)
            [(0, 4, 2), (1, 0, 2)]
        """
        found = []
        for index, (offset, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                found.append((index, low - offset, high - low))
        return found

    def holders(self, variable: int) -> list[tuple[int, tuple[int, int]]]:
        """(slice, [start, stop) of the variable's elements it holds) for every slice holding
        part of `variable`, in slice order.

        Example:
            >>> SliceLayout([6, 3], parts=2).holders(0)
            [(0, (0, 5)), (1, (5, 6))]
        """
        found = []
        offset, size = self.offsets[variable], self.sizes[variable]
        for part in range(self.parts):
            start, stop = self.bounds(part)
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                found.append((part, (low - offset, high - offset)))
        return found

    def owners(self, variable: int) -> list[int]:
        """The slices holding some element of `variable`."""
        return [
            p for p in range(self.parts) if any(x.variable == variable for x in self.extents(p))
        ]


def dense_segment_positions(dense: list[int], segments) -> list[list[int]]:
    """The dense positions of each of `segments` in order, then those of none (None: all one).

    Example:
        >>> dense_segment_positions([0, 1, 3, 4], [[4, 3], [1, 2]])
        [[3, 4], [1], [0]]
    """
    if segments is None:
        return [list(dense)]
    wanted = set(dense)
    found = [sorted(i for i in members if i in wanted) for members in segments]
    placed = {i for members in found for i in members}
    rest = [i for i in dense if i not in placed]
    return [m for m in found if m] + ([rest] if rest else [])


def group_by_dtype(dtypes: list[str]) -> dict[str, list[int]]:
    """Positions of each dtype among `dtypes`, in first-seen order: one flat vector each.

    Example:
        >>> group_by_dtype(["float32", "float16", "float32"])
        {'float32': [0, 2], 'float16': [1]}
    """
    groups: dict[str, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(str(dtype), []).append(i)
    return groups


def ring_bytes(elements: int, parts: int, itemsize: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter (or all-gather) of `elements` over `parts`
    ranks: (parts - 1) of the parts slices. A ring allreduce is the two, 2(R-1)/R·n elements.

    Example:
        >>> ring_bytes(1000, 4, 4)
        3000
    """
    return (parts - 1) * (elements // parts) * itemsize

"""Each weight tap's shape for a micro-batch, from the input dimensions it follows (pure).

A split backward (engine/stages/weight_taps.py) needs one zero tensor per tapped layer output, made
before the forward runs. Traced with the batch size and the varying lengths unknown, a tapped
output shows which of its dimensions vary (None); one trace at the first micro-batch's exact
shapes says which input dimension each of them equals. A dimension equal to several input
dimensions there (a token input and its padding mask have the same length) keeps them all as
candidates, and a later micro-batch on which they differ is traced at its shapes once more to
keep those that still match (`narrow`).

A dimension is an int (fixed) or a frozenset of candidate `(input, axis)` pairs; a shape is a
tuple of them.
"""

from __future__ import annotations

Dim = int | frozenset


def template(
    relaxed: list[tuple], exact: list[tuple], inputs: list[tuple], varying: list[tuple]
) -> list[tuple] | str:
    """The taps' shapes as `Dim`s, or why they cannot be known before a forward.

    `relaxed`: each tapped output's shape traced with unknown dimensions (None); `exact`: the
    same outputs traced at the shapes `inputs` (each flattened input's); `varying`: each
    input's shape in the relaxed trace (None where it varies).

    Example:
        >>> template([(None, None, 16)], [(2, 7, 16)], [(2, 7, 16)], [(None, None, 16)])
        [(frozenset({(0, 0)}), frozenset({(0, 1)}), 16)]
        >>> template([(None, 8)], [(14, 8)], [(2, 7)], [(None, None)])
        'a tapped output has a varying dimension (14) equal to no varying input dimension'
    """
    if len(relaxed) != len(exact):
        return "the forward makes other layer calls at other shapes"
    shapes = []
    for loose, fixed in zip(relaxed, exact, strict=True):
        if len(loose) != len(fixed):
            return "a tapped output changes rank with its input's shape"
        dims = []
        for want, have in zip(loose, fixed, strict=True):
            if want is not None:
                dims.append(want)
                continue
            found = frozenset(
                (a, k)
                for a, (shape, loose_input) in enumerate(zip(inputs, varying, strict=True))
                for k, (dim, free) in enumerate(zip(shape, loose_input, strict=True))
                if free is None and dim == have
            )
            if not found:
                return (
                    f"a tapped output has a varying dimension ({have}) equal to no varying "
                    "input dimension"
                )
            dims.append(found)
        shapes.append(tuple(dims))
    return shapes


def resolve(shapes: list[tuple], inputs: list[tuple]) -> list[tuple] | None:
    """The taps' shapes for micro-batch inputs of shapes `inputs`, or None where some dimension's
    candidates disagree (`narrow` first).

    Example:
        >>> shapes = [(frozenset({(0, 0)}), frozenset({(0, 1), (1, 1)}), 16)]
        >>> resolve(shapes, [(3, 9), (3, 9)]), resolve(shapes, [(3, 9), (3, 5)])
        ([(3, 9, 16)], None)
    """
    resolved = []
    for shape in shapes:
        dims = []
        for dim in shape:
            if isinstance(dim, int):
                dims.append(dim)
                continue
            sizes = {inputs[a][k] for a, k in dim}
            if len(sizes) != 1:
                return None
            dims.append(sizes.pop())
        resolved.append(tuple(dims))
    return resolved


def narrow(shapes: list[tuple], exact: list[tuple], inputs: list[tuple]) -> list[tuple] | str:
    """`shapes` keeping, for each varying dimension, the candidates that equal it in `exact`
    (the outputs traced at input shapes `inputs`), or why none does.

    Example:
        >>> narrow([(frozenset({(0, 1), (1, 1)}),)], [(5,)], [(3, 9), (3, 5)])
        [(frozenset({(1, 1)}),)]
    """
    if len(shapes) != len(exact):
        return "the forward makes other layer calls at other shapes"
    narrowed = []
    for shape, fixed in zip(shapes, exact, strict=True):
        dims = []
        for dim, have in zip(shape, fixed, strict=True):
            if isinstance(dim, int):
                dims.append(dim)
                continue
            kept = frozenset((a, k) for a, k in dim if inputs[a][k] == have)
            if not kept:
                return f"a tapped output's dimension ({have}) follows no input dimension"
            dims.append(kept)
        narrowed.append(tuple(dims))
    return narrowed


def specs_shape(shape: tuple) -> tuple:
    """`shape` for a `tf.TensorSpec`: varying dimensions None."""
    return tuple(d if isinstance(d, int) else None for d in shape)

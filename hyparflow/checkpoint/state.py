"""A rank's share of the training state, keyed so that another partitioning can load it.

Keys name positions in the user's model, never Keras's auto-generated names (a new process may
number layers differently): `w/<i>` is `model.weights[i]`, `opt/<i>/<slot>` an optimizer slot
of `model.trainable_variables[i]`, `opt/<name>` a global optimizer variable (iteration, learning
rate), `seed/<layer>/<j>` a layer's random seed state, `m/<i>` a summed metric state.

Under tensor parallelism a split variable's weight and slots are saved by every tensor rank as
its piece, `<key>@<t>/<T>:<axis>`; `join_shards` puts the pieces back together on reading, so a
checkpoint resumes with any number of tensor ranks (and stages and replicas). Expert
parallelism saves each expert group position's experts the same way, cut along axis 0.

Under ZeRO-1 (`Strategy(shard_optimizer=True)`) each replica saves only its slice of each
slot, as a range of the flattened entry: `<key>#<start>:<stop>/<shape>` (after the tensor
piece's `@...` where there is one); `join_shards` puts those ranges back together first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyparflow import _keras


def weight_specs(model) -> list:
    """[path, shape, dtype] of every model weight: the checkpoint's fingerprint of the model."""
    return [[v.path, list(v.shape), str(v.dtype)] for v in model.weights]


def _slot_prefixes(model) -> list[tuple[str, int]]:
    prefixes = [
        (v.path.replace("/", "_") + "_", i) for i, v in enumerate(model.trainable_variables)
    ]
    return sorted(prefixes, key=lambda p: -len(p[0]))  # longest first: "d_1_k_" before "d_1_"


def shard_key(key: str, shard: int, parts: int, axis: int) -> str:
    """The key of tensor rank `shard`'s piece (of `parts`, cut along `axis`) of entry `key`."""
    return f"{key}@{shard}/{parts}:{axis}"


def split_key(key: str):
    """(base key, (shard, parts, axis)) of a piece's key; (key, None) for a whole entry."""
    base, at, where = key.partition("@")
    if not at:
        return key, None
    shard, rest = where.split("/")
    parts, axis = rest.split(":")
    return base, (int(shard), int(parts), int(axis))


def join_pieces(base: str, found: dict):
    """Entry `base` from its pieces, `found`: shard -> (parts, axis, value)."""
    parts, axis, _ = next(iter(found.values()))
    if sorted(found) != list(range(parts)):
        raise ValueError(
            f"The checkpoint holds pieces {sorted(found)} of {parts} of {base!r}; a tensor "
            "rank's file is missing."
        )
    return np.concatenate([found[t][2] for t in range(parts)], axis=axis)


def slice_key(key: str, start: int, stop: int, shape) -> str:
    """The key of the flat elements [start, stop) of entry `key` of `shape` (a ZeRO slice).

    Example:
        >>> slice_key("opt/3/momentum", 0, 40, (4, 20))
        'opt/3/momentum#0:40/4x20'
    """
    return f"{key}#{start}:{stop}/{'x'.join(str(int(d)) for d in shape)}"


def split_slice_key(key: str):
    """(base key, (start, stop, shape)) of a ZeRO slice's key; (key, None) for anything else."""
    base, hash_, where = key.rpartition("#")
    if not hash_:
        return key, None
    span, _, shape = where.partition("/")
    start, _, stop = span.partition(":")
    dims = tuple(int(d) for d in shape.split("x")) if shape else ()
    return base, (int(start), int(stop), dims)


def join_ranges(base: str, dims: tuple, found: list):
    """Entry `base` of shape `dims` from its flat ranges `found`: [(start, stop, value)]; ranges
    that do not cover it exactly are an error."""
    found = sorted(found, key=lambda r: r[0])
    size = int(np.prod(dims, dtype=np.int64))
    ends = [0] + [stop for _, stop, _ in found]
    if [start for start, _, _ in found] != ends[:-1] or ends[-1] != size:
        raise ValueError(
            f"The checkpoint holds elements {[(a, b) for a, b, _ in found]} of {size} of "
            f"{base!r}; a replica's file is missing."
        )
    return np.concatenate([np.ravel(v) for _, _, v in found]).reshape(dims)


def _join(state: dict, split, add, join) -> dict:
    """`state` with the parts of every entry `split(key)` names put together by `join`: split
    gives (base key, where or None), `add(parts, where, value)` collects a part."""
    parts: dict = {}
    joined = {}
    for key, value in state.items():
        base, where = split(key)
        if where is None:
            joined[key] = value
        else:
            add(parts.setdefault(base, {}), where, value)
    for base, found in parts.items():
        joined[base] = join(base, found)
    return joined


def join_slices(state: dict) -> dict:
    """`state` with the flat ranges of every sliced entry (`slice_key`) joined into the
    entry's whole array.

    Example:
        >>> join_slices({"a#0:2/3": np.ones(2), "a#2:3/3": np.zeros(1)})["a"].tolist()
        [1.0, 1.0, 0.0]
    """

    def add(found: dict, where, value) -> None:
        start, stop, dims = where
        found.setdefault("ranges", []).append((start, stop, value))
        found["dims"] = dims

    return _join(
        state,
        split_slice_key,
        add,
        lambda base, found: join_ranges(base, found["dims"], found["ranges"]),
    )


def join_shards(state: dict) -> dict:
    """`state` with every split entry's pieces put together along their axis, in shard order
    (ZeRO's flat ranges of each piece joined first)."""

    def add(found: dict, where, value) -> None:
        shard, parts, axis = where
        found[shard] = (parts, axis, value)

    return _join(join_slices(state), split_key, add, join_pieces)


def cut_shard(value, shard: int, parts: int, axis: int):
    """Tensor rank `shard`'s piece of `value`, cut in `parts` along `axis`."""
    step = value.shape[axis] // parts
    return np.take(value, np.arange(shard * step, (shard + 1) * step), axis=axis)


@dataclass(frozen=True)
class Piece:
    """A rank's part of a split variable: part `index` of `parts`, cut along `axis` (a tensor
    shard, or an expert group position's experts along axis 0), split `over` "tensor" ranks or
    "experts" (the positions of an expert group)."""

    index: int
    parts: int
    axis: int
    over: str = "tensor"

    def written_by(self, shard: int, replica: int) -> bool:
        """Whether the rank at tensor `shard` of `replica` writes this piece, so that one rank
        writes each: a tensor piece the first replica's rank, an expert piece the first tensor
        rank of the first expert group (replicas `0..parts-1`, `comm.topology.expert_group`);
        the others hold copies."""
        if self.over == "tensor":
            return replica == 0
        return shard == 0 and replica < self.parts

    def key(self, key: str) -> str:
        """The key of this piece of entry `key`."""
        return shard_key(key, self.index, self.parts, self.axis)

    def cut(self, value):
        """This piece of the whole `value`."""
        return cut_shard(value, self.index, self.parts, self.axis)


def written_pieces(split: dict, shard: int, replica: int) -> dict:
    """The entries of `split` (path -> `Piece`) that the rank at tensor `shard` of `replica`
    writes (`Piece.written_by`)."""
    return {path: piece for path, piece in split.items() if piece.written_by(shard, replica)}


def optimizer_state(model, optimizer, split=None) -> dict:
    """The values of the optimizer's variables, keyed as `optimizer_slots` keys them."""
    slots = optimizer_slots(model, optimizer, split)
    return {key: np.asarray(variable.numpy()) for key, variable in slots.items()}


def optimizer_slots(model, optimizer, split=None) -> dict:
    """The optimizer's variables, keyed by model variable index and slot name. `split` maps the
    path of each variable this rank holds a part of to its `Piece`: their slots are pieces."""
    split = split or {}
    prefixes = _slot_prefixes(model)
    paths = [v.path for v in model.trainable_variables]
    slots = {}
    for variable in optimizer.variables:
        name = variable.name
        for prefix, index in prefixes:
            if name.startswith(prefix):
                key = f"opt/{index}/{name[len(prefix) :]}"
                if paths[index] in split:
                    key = split[paths[index]].key(key)
                slots[key] = variable
                break
        else:
            slots[f"opt/{name}"] = variable
    return slots


def restore_optimizer(model, optimizer, variables, state: dict, split=None):
    """Build `optimizer` for `variables` (a stage's) and load their slots from `state` (whole:
    a split variable's slot, `split` path -> `Piece`, takes this rank's piece)."""
    split = split or {}
    paths = [v.path for v in model.trainable_variables]
    if variables and not optimizer.built:
        optimizer.build(variables)
    prefixes = _slot_prefixes(model)
    missing = []
    for variable in optimizer.variables:
        name = variable.name
        key, piece = f"opt/{name}", None
        for prefix, index in prefixes:
            if name.startswith(prefix):
                key = f"opt/{index}/{name[len(prefix) :]}"
                piece = split.get(paths[index])
                break
        if key in state:
            value = state[key]
            variable.assign(value if piece is None else piece.cut(value))
        else:
            missing.append(name)
    if missing:
        raise ValueError(
            f"The checkpoint has no optimizer state for {missing[:3]}; it was written with a "
            f"different optimizer. Compile with the optimizer it was trained with, or start "
            "without resume."
        )


def seed_generators(model) -> list[tuple[str, object]]:
    """(key, state variable) of every layer's random seed generator (Dropout and friends)."""
    found = []
    for index, layer in enumerate(_keras.all_layers(model, include_self=False)):
        for j, generator in enumerate(_keras.seed_generators(layer)):
            found.append((f"seed/{index}/{j}", generator.state))
    return found


def layers_of_seed_keys(model) -> dict:
    """Seed key -> layer object, so the stage that calls a layer saves its generator."""
    owners = {}
    for index, layer in enumerate(_keras.all_layers(model, include_self=False)):
        for j, _ in enumerate(_keras.seed_generators(layer)):
            owners[f"seed/{index}/{j}"] = layer
    return owners

"""What a model costs to train, per layer and per engine call, as data that can be saved.

Times are affine in the batch (`fixed + per_sample * batch`): a layer's kernels scale with the
samples, while launching them costs the same for 4 samples or 400, which matters for the small
micro-batches of a pipeline. `measure.py` fills this in on a real machine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from hyparflow.partitioner.balance import split_contiguous

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Affine:
    """Seconds as a function of the batch: `fixed + per_sample * batch`.

    Example:
        >>> Affine(0.001, 0.0001).at(64)
        0.0074
    """

    fixed: float = 0.0
    per_sample: float = 0.0

    def at(self, batch: float) -> float:
        return self.fixed + self.per_sample * batch

    def scaled(self, factor: float) -> Affine:
        return Affine(self.fixed * factor, self.per_sample * factor)

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.fixed + other.fixed, self.per_sample + other.per_sample)

    def __sub__(self, other: Affine) -> Affine:
        return Affine(self.fixed - other.fixed, self.per_sample - other.per_sample)

    @classmethod
    def through(cls, batch_a: float, time_a: float, batch_b: float, time_b: float) -> Affine:
        """The line through two measurements, kept non-negative in both terms (timing noise
        can tilt a line through two points below zero at batch 0).

        Example:
            >>> Affine.through(32, 0.004, 128, 0.013)
            Affine(fixed=0.001, per_sample=9.375e-05)
        """
        if batch_a == batch_b:
            return cls(0.0, max(time_a, time_b, 0.0) / batch_a)
        slope = (time_b - time_a) / (batch_b - batch_a)
        fixed = time_a - slope * batch_a
        if slope < 0:
            return cls(max(0.0, (time_a + time_b) / 2), 0.0)
        if fixed < 0:
            return cls(0.0, max(time_b, 0.0) / batch_b)
        return cls(round(fixed, 12), round(slope, 15))

    @classmethod
    def of(cls, value) -> Affine:
        """From an Affine, a `[fixed, per_sample]` pair or a dict with those keys."""
        if isinstance(value, dict):
            value = (value["fixed"], value["per_sample"])
        return value if isinstance(value, Affine) else cls(*(float(v) for v in value))


@dataclass(frozen=True)
class TensorShare:
    """What a layer call does when tensor ranks split it (measured for `tensor_layout`'s
    rules): the bytes of its parameters that split (counted at its first call, like
    `LayerCost.param_bytes`), the fraction of its parameters, hence of its compute, that
    splits, and the activations it sums over the ranks: bytes per sample and collectives, in
    the forward (after row layers) and in the backward (the input gradients of column ones)."""

    split_bytes: int = 0
    split_fraction: float = 0.0
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    forward_calls: int = 0
    backward_calls: int = 0


@dataclass(frozen=True)
class LayerCost:
    """One layer call (a node of the partitioner's graph): its forward and backward time, the
    trainable parameters it owns (counted at its first call only) and its `TensorShare`."""

    name: str
    forward: Affine
    backward: Affine
    param_bytes: int = 0
    variables: int = 0
    tensor: TensorShare = TensorShare()


@dataclass(frozen=True)
class EngineCosts:
    """What the engine adds around the layers: per stage call beyond the layers' own time
    (`forward_call`, `backward_call`), the last stage's loss and metrics per micro-batch,
    summing a micro-batch's gradients per parameter byte (`accumulate_per_byte`, every
    micro-batch after the first), a stage's optimizer update, and per step the last stage's
    read-out of the logs when callbacks read them (`step_fixed`). Where tensor ranks or
    ZeRO-1 run: an in-graph collective's host round trip beyond the network's time
    (`collective_call`), and ZeRO-1's host work per parameter byte beyond plain data
    parallelism's update (`sharded_update_per_byte`: its reduce-scatter's buffers, the slice's
    refresh, the gathered parameters assigned back)."""

    forward_call: float = 0.0
    backward_call: float = 0.0
    loss: Affine = Affine()
    accumulate_per_byte: float = 0.0
    optimizer_fixed: float = 0.0
    optimizer_per_variable: float = 0.0
    optimizer_per_byte: float = 0.0
    step_fixed: float = 0.0
    collective_call: float = 0.0
    sharded_update_per_byte: float = 0.0

    def optimizer(self, variables: int, nbytes: float) -> float:
        """The update of `variables` of `nbytes`; stages without variables skip it."""
        if not variables:
            return 0.0
        return (
            self.optimizer_fixed
            + self.optimizer_per_variable * variables
            + (self.optimizer_per_byte * nbytes)
        )


@dataclass(frozen=True)
class StageCost:
    """A contiguous run of layers at one micro-batch size: compute seconds and what it owns.
    `weight_backward` is the part of `backward` that computes weight gradients, taken as half
    the backward of each layer with weights (a matmul's input and weight gradients cost the
    same): ZB-H1's W pass."""

    forward: float
    backward: float
    param_bytes: int
    variables: int
    weight_backward: float = 0.0


@dataclass
class ModelCosts:
    """Per-layer costs of one model on one machine, plus the engine's costs around them.

    `cut_bytes[j]` are the bytes per sample of every tensor alive across the cut before layer
    `j` (what crosses a stage boundary there, skips forwarded included); entries 0 and `n` are
    0. `single_process` is a plain `model.fit` step (what hyparflow runs on one rank) at a
    given batch, when measured; `fused` the engine's one-call step of the whole model per
    micro-batch (what a data-parallel rank computes), when measured. `measured` records where
    and how the numbers were taken.
    """

    name: str
    layers: list[LayerCost]
    cut_bytes: list[float]
    engine: EngineCosts = field(default_factory=EngineCosts)
    single_process: Affine | None = None
    measured: dict = field(default_factory=dict)
    fused: Affine | None = None

    def __post_init__(self):
        if len(self.cut_bytes) != len(self.layers) + 1:
            raise ValueError(
                f"cut_bytes needs one entry per cut ({len(self.layers) + 1}), "
                f"got {len(self.cut_bytes)}"
            )

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def variables(self) -> int:
        return sum(layer.variables for layer in self.layers)

    def layer_times(self, batch: float) -> np.ndarray:
        """Forward plus backward seconds of every layer at `batch` samples; the loss counts
        with the last layer (it always runs on the last stage)."""
        times = np.array([lc.forward.at(batch) + lc.backward.at(batch) for lc in self.layers])
        times[-1] += self.engine.loss.at(batch)
        return times

    def split(self, partitions: int, batch: float) -> list[int]:
        """Where stages begin when balancing by time at `batch` samples per micro-batch, as
        the partitioner's `balance="time"` does (same exact dynamic programme)."""
        return split_contiguous(self.layer_times(batch), partitions)

    def stage(self, start: int, end: int, batch: float) -> StageCost:
        """Layers `start` to `end - 1` at `batch` samples (compute only, no engine costs)."""
        layers = self.layers[start:end]
        return StageCost(
            forward=sum(lc.forward.at(batch) for lc in layers),
            backward=sum(lc.backward.at(batch) for lc in layers),
            param_bytes=sum(lc.param_bytes for lc in layers),
            variables=sum(lc.variables for lc in layers),
            weight_backward=sum(lc.backward.at(batch) / 2 for lc in layers if lc.variables),
        )

    def start_names(self, starts: list[int]) -> list[str]:
        """Names of the layers where stages 1, 2, ... begin: `hf.Strategy(balance=...)`."""
        return [self.layers[s].name for s in starts[1:]]

    def scaled(self, factor: float) -> ModelCosts:
        """These costs on a processor `factor` times slower: every time, the engine's too."""

        def slower(value):
            return value.scaled(factor) if isinstance(value, Affine) else value * factor

        layers = [
            replace(lc, forward=slower(lc.forward), backward=slower(lc.backward))
            for lc in self.layers
        ]
        engine = replace(
            self.engine,
            **{f.name: slower(getattr(self.engine, f.name)) for f in fields(EngineCosts)},
        )
        single, fused = (
            None if a is None else slower(a) for a in (self.single_process, self.fused)
        )
        return ModelCosts(
            self.name, layers, list(self.cut_bytes), engine, single, dict(self.measured), fused
        )

    def to_dict(self) -> dict:
        data = asdict(self)  # Affines as {"fixed", "per_sample"}
        return {"format": "hyparflow-costs", "version": FORMAT_VERSION, **data}

    @classmethod
    def from_dict(cls, data: dict) -> ModelCosts:
        if data.get("format") != "hyparflow-costs":
            raise ValueError(
                "not a hyparflow costs file (no 'format': 'hyparflow-costs'); write one with "
                "`hyparflow simulate MODEL.keras --save-costs FILE`"
            )
        known = {f.name for f in fields(EngineCosts)}  # older files may hold more
        engine = {k: v for k, v in data.get("engine", {}).items() if k in known}
        engine["loss"] = Affine.of(engine.get("loss", (0.0, 0.0)))
        layers = [
            LayerCost(
                layer["name"],
                Affine.of(layer["forward"]),
                Affine.of(layer["backward"]),
                int(layer.get("param_bytes", 0)),
                int(layer.get("variables", 0)),
                TensorShare(**layer.get("tensor", {})),
            )
            for layer in data["layers"]
        ]
        single, fused = (data.get(k) and Affine.of(data[k]) for k in ("single_process", "fused"))
        cuts, measured = [float(b) for b in data["cut_bytes"]], dict(data.get("measured", {}))
        return cls(
            data.get("name", "model"), layers, cuts, EngineCosts(**engine), single, measured, fused
        )

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path) -> ModelCosts:
        with open(path) as f:
            return cls.from_dict(json.load(f))

"""The result of partitioning: stages with their sub-models, boundary tensors and costs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

import numpy as np
from keras import tree

from hyparflow import _keras
from hyparflow.partitioner import profile
from hyparflow.partitioner.graph import numpy_dtype


@dataclass(frozen=True)
class BoundaryTensor:
    """A tensor crossing the link into (`receives`) or out of (`sends`) a stage.

    `source_stage` computed it (-1: a model input); `dest_stage` is the last stage that reads
    it (-1: a model output, needed at the end). `forwarded` marks a tensor the sending stage
    only passes on (it received it and does not compute it). `shape` excludes the batch
    dimension.
    """

    name: str
    shape: tuple
    dtype: str
    source_stage: int
    dest_stage: int
    forwarded: bool = False
    consumer_stages: tuple = ()

    @property
    def bytes_per_sample(self) -> int:
        """Bytes of one sample; unknown (None) dimensions count as 1."""

        itemsize = np.dtype(numpy_dtype(self.dtype)).itemsize
        return math.prod(1 if d is None else int(d) for d in self.shape) * itemsize

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "source_stage": self.source_stage,
            "dest_stage": self.dest_stage,
            "forwarded": self.forwarded,
            "consumer_stages": list(self.consumer_stages),
        }


@dataclass(eq=False)
class Stage:
    """One pipeline stage: a `keras.Model` sharing the user's layers, and what it exchanges.

    `model.inputs` match `receives` and `model.outputs` match `sends`, in order. `layers` are
    the Keras layers it calls (nested models' layers as "outer/inner"), `ops` the `keras.ops`
    operations, `nodes` every call (a layer called twice appears as "name#0", "name#1").
    """

    index: int
    model: object
    layers: list[str]
    ops: list[str]
    nodes: list[str]
    receives: list[BoundaryTensor]
    sends: list[BoundaryTensor]
    cost: float
    comm_cost: float
    param_count: int
    owned_layers: list[str]
    measured_time: float | None = None
    layer_objects: dict = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return (
            f"Stage({self.index}: {len(self.layers)} layers, {len(self.ops)} ops, "
            f"{self.param_count:,} params, cost {self.cost:.4g}, "
            f"receives {len(self.receives)}, sends {len(self.sends)})"
        )

    def forward(self, inputs: list, training=None) -> list:
        """Run the stage on the list of received tensors; returns the list of sent tensors."""
        outputs = self.model(list(inputs), training=training)
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]

    def owned_losses(self) -> list:
        """Losses this stage adds to the step: losses its layers added during the last call
        (activity regularization, `add_loss`) plus weight regularization of the layers it owns.

        `model.losses` also counts the weights of shared layers owned by another stage; sum
        `owned_losses()` over stages to count every regularizer exactly once. Call it right
        after `model(...)`, before another stage calls a shared layer.
        """
        losses = []
        for layer in _keras.all_layers(self.model, include_self=False):
            losses.extend(_keras.own_losses(layer))
        owned = {
            id(v) for name in self.owned_layers for v in self.layer_objects[name].trainable_weights
        }
        for variable in self.model.trainable_weights:
            if variable.regularizer is not None and id(variable) in owned:
                losses.append(variable.regularizer(variable))
        return losses

    @property
    def bytes_received_per_sample(self) -> int:
        return sum(t.bytes_per_sample for t in self.receives)

    @property
    def bytes_sent_per_sample(self) -> int:
        return sum(t.bytes_per_sample for t in self.sends)

    def to_dict(self) -> dict:
        """Its fields as JSON-ready data, in their order, the boundaries last; no Keras objects."""
        left_out = {"model", "layer_objects", "receives", "sends"}
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in left_out}
        data["receives"] = [t.to_dict() for t in self.receives]
        data["sends"] = [t.to_dict() for t in self.sends]
        return data


@dataclass(eq=False)
class Plan:
    """Pipeline stages of a model, as a linear chain: stage i+1 receives what stage i sends.

    For example:
        plan = hyparflow.partition(model, 4, balance="flops")
        plan.summary()
        y = plan.run(x)  # same as model(x)
    """

    model: object
    stages: list[Stage]
    balance: object
    shared_layers: dict[str, list[int]]
    cost_unit: str  # unit of `stage.cost`: "layers", "params", "FLOP" or "s"
    batch_size: int | None = None
    bandwidth: float | None = None
    graph: object = field(default=None, repr=False)
    # Each stage's tensor layout when its layers are split over tensor ranks (`hf.partition(...,
    # tensor=T)`): objects with `summary()` and `layout_map()` (hyparflow.tensor.TensorLayout).
    tensor_layouts: list = field(default_factory=list, repr=False)
    # Model chunks each pipeline rank runs (interleaved schedules): the stages are the model's
    # chunks, and pipeline rank r holds stages r, r + P, r + 2P, ... (P = `pipeline_ranks`).
    virtual_stages: int = 1

    def __repr__(self) -> str:
        return (
            f"Plan('{self.model.name}', {self.num_partitions} stages, balance="
            f"{self._balance_label()}, estimated imbalance {self.estimated_imbalance:.3f})"
        )

    @property
    def num_partitions(self) -> int:
        return len(self.stages)

    @property
    def pipeline_ranks(self) -> int:
        """The ranks of one pipeline: one per stage, or one per `virtual_stages` chunks."""
        return len(self.stages) // self.virtual_stages

    def holder(self, stage_index: int) -> int:
        """The pipeline rank that runs stage `stage_index` (itself unless interleaved)."""
        return stage_index % self.pipeline_ranks

    def stages_on(self, rank: int) -> list[Stage]:
        """The stages pipeline rank `rank` runs, in model order."""
        return self.stages[rank :: self.pipeline_ranks]

    def run(self, inputs, training=None):
        """Run the stages one after another; returns what `model(inputs)` returns."""

        root = self.graph.root
        values = _keras.standardize_inputs(root, inputs)
        for stage in self.stages:
            values = stage.forward(values, training=training)
        return _keras.unpack_singleton(
            tree.pack_sequence_as(_keras.outputs_structure(root), values)
        )

    def profile(self, sample=None, input_shape=None, batch_size=None, repeats=5) -> list[float]:
        """Measure each stage's forward+backward seconds on a batch; stored in
        `stage.measured_time` and shown by `summary()`."""

        batch_size = batch_size or self.batch_size
        inputs = profile.make_sample(self.graph, sample, input_shape, batch_size)
        times = profile.stage_times(self.stages, inputs, self.model, repeats)
        for stage, seconds in zip(self.stages, times, strict=True):
            stage.measured_time = seconds
        return times

    @property
    def estimated_imbalance(self) -> float:
        """Slowest estimated stage cost over the mean (1.0 is perfect balance)."""
        return _imbalance([s.cost for s in self.stages])

    @property
    def measured_imbalance(self) -> float | None:
        """Slowest measured stage time over the mean, or None before `profile()`."""
        times = [s.measured_time for s in self.stages]
        return None if None in times else _imbalance(times)

    def layer(self, name: str):
        """The Keras layer called `name` in `stage.layers` (qualified names for nested ones)."""
        for stage in self.stages:
            if name in stage.layer_objects:
                return stage.layer_objects[name]
        raise KeyError(f"No layer '{name}' in this plan.")

    def summary(self, print_fn=print) -> str:
        """Print and return a table: per stage layers, parameters, estimated cost, measured
        time, bytes sent per sample; then the imbalance (slowest / mean)."""
        measured = self.measured_imbalance is not None
        display_unit = {"s": "ms", "FLOP": "MFLOP"}.get(self.cost_unit, self.cost_unit)
        header = ["stage", "layers", "params", f"est. cost ({display_unit})"]
        header += ["measured (ms)"] if measured else []
        header += ["sent/sample", "receives", "sends (fwd)"]
        rows = []
        for s in self.stages:
            row = [
                str(s.index),
                str(len(s.layers) + len(s.ops)),
                f"{s.param_count:,}",
                _format_cost(s.cost, self.cost_unit),
            ]
            row += [f"{s.measured_time * 1e3:.2f}"] if measured else []
            forwarded = sum(t.forwarded for t in s.sends)
            row += [_format_bytes(s.bytes_sent_per_sample), str(len(s.receives))]
            row += [f"{len(s.sends)} ({forwarded})"]
            rows.append(row)
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            f"Plan for '{self.model.name}': {self.num_partitions} stages, "
            f"balance={self._balance_label()}"
            + (f", bandwidth={self.bandwidth:g} B/unit" if self.bandwidth else ""),
            "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        ]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        imbalance = f"imbalance (slowest/mean): estimated {self.estimated_imbalance:.3f}"
        if measured:
            imbalance += f", measured {self.measured_imbalance:.3f}"
        lines.append(imbalance)
        if self.shared_layers:
            shared = ", ".join(f"{n} {v}" for n, v in self.shared_layers.items())
            lines.append(f"shared layers (stages): {shared}")
        for index, layout in enumerate(self.tensor_layouts):
            lines.append(f"stage {index}: " + layout.summary())
        text = "\n".join(lines)
        if print_fn is not None:
            print_fn(text)
        return text

    def to_dict(self) -> dict:
        return {
            "model": self.model.name,
            "num_partitions": self.num_partitions,
            "balance": self.balance if isinstance(self.balance, str) else list(self.balance),
            "cost_unit": self.cost_unit,
            "batch_size": self.batch_size,
            "bandwidth": self.bandwidth,
            "estimated_imbalance": self.estimated_imbalance,
            "measured_imbalance": self.measured_imbalance,
            "shared_layers": self.shared_layers,
            "stages": [s.to_dict() for s in self.stages],
            "tensor_layouts": [layout.to_dict() for layout in self.tensor_layouts],
        }

    def to_json(self, indent=2) -> str:
        """The plan (without the Keras models) as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def _balance_label(self) -> str:
        return self.balance if isinstance(self.balance, str) else "explicit"


def _imbalance(values) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def _format_cost(cost: float, unit: str) -> str:
    if unit == "s":
        return f"{cost * 1e3:.2f}"
    if unit == "FLOP":
        return f"{cost / 1e6:,.1f}"
    return f"{cost:,.0f}"


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)

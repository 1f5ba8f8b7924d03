"""A memory plan's result: per-rank lines of bytes, their peak, a table and JSON (pure)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from hyparflow.memory.counts import peak

_MIB = 2**20


@dataclass
class RankMemory:
    """Predicted bytes of one rank (`stage`, `replica`, tensor `shard`), line by line.

    Persistent: `weights` (the stage's variables, a split one as its shard), `model_copy` (the
    rest of the user's model, which every rank holds unless it was built in `hf.scope`),
    `optimizer` (its slots), `runtime` (TensorFlow's own, a measured constant). During a
    step: `gradients`, `activations`, `step_buffers` (the engine's). At an epoch's end:
    `exchange` (the engine's weight exchange). `total` is the peak (`counts.peak`).
    """

    rank: int
    stage: int
    replica: int
    shard: int
    weights: int
    model_copy: int
    optimizer: int
    gradients: int
    activations: int
    step_buffers: dict = field(default_factory=dict)
    exchange: dict = field(default_factory=dict)
    runtime: int = 0

    @property
    def persistent(self) -> int:
        return self.weights + self.model_copy + self.optimizer + self.runtime

    @property
    def step(self) -> int:
        return self.gradients + self.activations + sum(self.step_buffers.values())

    @property
    def engine(self) -> int:
        """The engine's own buffers: a step's and the epoch end's."""
        return sum(self.step_buffers.values()) + sum(self.exchange.values())

    @property
    def total(self) -> int:
        return peak(self.persistent, self.step, sum(self.exchange.values()))

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(engine=self.engine, total=self.total)
        return data


@dataclass
class MemoryPlan:
    """Every rank's predicted memory for one model, strategy and batch size.

    For example:
        plan = hf.memory_plan(model, hf.Strategy("model", partitions=2), batch_size=64)
        plan.largest.total / 2**20  # MiB on the fullest rank
        print(plan.summary(print_fn=None))
    """

    model: str
    strategy: str
    batch_size: int
    ranks: list[RankMemory]
    notes: list[str] = field(default_factory=list)

    @property
    def largest(self) -> RankMemory:
        """The rank predicted to peak highest (the first of equals)."""
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "strategy": self.strategy,
            "batch_size": self.batch_size,
            "largest_rank": self.largest.rank,
            "largest_bytes": self.largest.total,
            "ranks": [r.to_dict() for r in self.ranks],
            "notes": list(self.notes),
        }

    def to_json(self, indent=2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self, print_fn=print) -> str:
        """Print and return a table of every rank's lines in MiB, the largest rank marked."""
        header = ["rank", "stage", "replica", "shard", "weights", "copy", "optim", "grads"]
        header += ["activ", "engine", "runtime", "total MiB"]
        largest = self.largest.rank
        rows = []
        for r in self.ranks:
            cells = [r.weights, r.model_copy, r.optimizer, r.gradients, r.activations]
            cells += [r.engine, r.runtime, r.total]
            mark = "*" if r.rank == largest else ""
            rows.append(
                [f"{r.rank}{mark}", str(r.stage), str(r.replica), str(r.shard)]
                + [f"{c / _MIB:,.1f}" for c in cells]
            )
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [
            f"Memory plan for '{self.model}': {self.strategy}, batch {self.batch_size} "
            "(MiB per rank; * the largest)",
            "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
        ]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        lines += [f"note: {n}" for n in self.notes]
        text = "\n".join(lines)
        if print_fn is not None:
            print_fn(text)
        return text

"""Training configurations of the equivalence scenarios: a frozen `Case` each, one launch for all.

A test lists its cases, e.g. `Case("resnet", "adam", "hybrid", partitions=2, replicas=2,
microbatches=2, schedule="1f1b", recompute=True)`, and parametrizes over them with `ids=str`
(`resnet-adam-hybrid-P2R2-M2-1f1b-recompute`). A module-scoped fixture launches the scenario
once per rank count for every case (`run_cases`, cases passed as JSON), since starting
TensorFlow on every rank costs seconds; each parametrized test then checks its own case's
results, so a failure names the case. `selected` narrows the launch to the cases this session
runs (`-k`, a node id, `--lf`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import hyparflow as hf
from tests.support.mpirun import run_scenario

# Every hf.Strategy field but `kind` is a Case field, with Strategy's default, except the grid's
# sizes: a case names them, 1 where it does not split that axis.
_GRID_DEFAULTS = {"partitions": 1, "replicas": 1}
_StrategyFields = dataclasses.make_dataclass(
    "_StrategyFields",
    [
        (
            f.name,
            f.type,
            dataclasses.field(default=_GRID_DEFAULTS.get(f.name, f.default), kw_only=True),
        )
        for f in dataclasses.fields(hf.Strategy)
        if f.name != "kind"
    ],
    frozen=True,
)
_STRATEGY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(hf.Strategy)}
# Fields that show in a case's id as a flag, in id order, each where it differs from its default
# (other Strategy fields a case sets show as name=value at the end)
_FLAGS = {
    "recompute": lambda c: "recompute" if c.recompute else "",
    "overlap_p2p": lambda c: "" if c.overlap_p2p else "blocking",
    "overlap_groups": lambda c: f"overlap{c.overlap_groups}" if c.overlap_groups > 1 else "",
    "flat_gradients": lambda c: "" if c.flat_gradients else "listgrads",
    "large_variables": lambda c: "largevars" if c.large_variables else "",
    "sync_batchnorm": lambda c: "syncbn" if c.sync_batchnorm else "",
    "one_step": lambda c: "1step" if c.one_step else "",
    "shard_optimizer": lambda c: "zero" if c.shard_optimizer and not c.shard_gradients else "",
    "shard_gradients": lambda c: "zero2" if c.shard_gradients and not c.shard_weights else "",
    "shard_weights": lambda c: "zero3" if c.shard_weights else "",
    "update_by_segment": lambda c: {True: "bysegment", False: "whole"}.get(c.update_by_segment, ""),
}
_IN_ID = {"partitions", "replicas", "tensor", "microbatches", "schedule"}  # shown before flags
# The Strategy fields of a layout the search reports (hf.auto's JSON, `hyparflow simulate`)
LAYOUT_FIELDS = (
    "kind",
    "partitions",
    "replicas",
    "tensor",
    "microbatches",
    "schedule",
    "recompute",
    "shard_optimizer",
)


@dataclass(frozen=True)
class Case(_StrategyFields):
    """One model trained by hf.fit under one layout, to be compared with Keras's own fit.

    `model` and `optimizer` are names the scenario's model module knows (tests/support/models.py
    or zoo.py); `kind` and every keyword that names a field of hf.Strategy (`partitions`,
    `microbatches`, `overlap_p2p`, `update_by_segment`, ...) are the layout, passed to
    hf.Strategy where they differ from its defaults. Only three fields are the tests' own:
    `policy` is the Keras dtype policy the model is built under; `large_variables` makes every
    variable count as large (summed per variable over micro-batches, flattened once per step,
    updated in a compiled optimizer call of its own); `one_step` trains a single step.
    """

    model: str
    optimizer: str
    kind: str
    policy: str = "float32"
    large_variables: bool = False
    one_step: bool = False

    def __str__(self) -> str:
        """The readable id: defaults left out, e.g. `mlp-sgd-data-R2`."""
        grid = (
            (f"P{self.partitions}" if self.partitions > 1 else "")
            + (f"R{self.replicas}" if self.replicas > 1 else "")
            + (f"T{self.tensor}" if self.tensor > 1 else "")
        )
        others = [
            f"{name}={value}"
            for name, value in self._changed_options().items()
            if name not in _FLAGS and name not in _IN_ID
        ]
        parts = [
            self.model,
            self.optimizer,
            self.kind,
            grid,
            f"M{self.microbatches}" if self.microbatches > 1 else "",
            self.schedule if self.schedule != "gpipe" else "",
            self.policy if self.policy != "float32" else "",
            *(flag(self) for flag in _FLAGS.values()),
            *others,
        ]
        return "-".join(p for p in parts if p)

    @property
    def id(self) -> str:
        return str(self)

    def _changed_options(self) -> dict:
        """The Strategy fields this case sets to something other than Strategy's default."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(_StrategyFields)
            if getattr(self, f.name) != _STRATEGY_DEFAULTS[f.name]
        }

    def strategy_options(self) -> dict:
        """Keyword arguments of hf.Strategy for this case."""
        grid = {"partitions": self.partitions, "replicas": self.replicas}
        return {"kind": self.kind, **grid, **self._changed_options()}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Case:
        return cls(**json.loads(text))


def selected(request, cases: list) -> list:
    """The cases among `cases` that some test this session runs takes as its `case` argument,
    in order; all of them if none does (a test that looks at every case's results)."""
    chosen = [
        item.callspec.params["case"]
        for item in request.session.items
        if "case" in getattr(getattr(item, "callspec", None), "params", {})
    ]
    picked = [c for c in cases if c in chosen]
    return picked or list(cases)


def run_cases(
    scenario: str, np: int, cases: list, *args: str, timeout: float, mpirun=("mpirun",)
) -> dict:
    """Launch `scenario` once on `np` ranks with `args`, then every case as JSON; the result:
    each case's id -> its rank results, rank 0 first. Every rank must report every case, in
    order, under "case". `mpirun`: the launcher (tests/support/mpirun.py)."""
    cases_json = (c.to_json() for c in cases)
    results = run_scenario(scenario, np, *args, *cases_json, timeout=timeout, mpirun=mpirun)
    by_case = {c.id: [] for c in cases}
    for rank, rank_result in enumerate(results):
        reported = [r["case"] for r in rank_result["results"]]
        assert reported == list(by_case), f"rank {rank} reported {reported}"
        for r in rank_result["results"]:
            by_case[r["case"]].append({"rank": rank, **r})
    return by_case


# The layouts most cases share, so that a table of cases keeps one line a case
def two_stages(model: str, optimizer: str, **options) -> Case:
    """A pipeline of two stages, one replica each."""
    return Case(model, optimizer, "model", partitions=2, **options)


def two_by_two(model: str, optimizer: str, **options) -> Case:
    """The four-rank hybrid grid: two pipeline stages, each replicated twice."""
    return Case(model, optimizer, "hybrid", partitions=2, replicas=2, **options)

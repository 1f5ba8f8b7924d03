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

from tests.support.mpirun import run_scenario

# options that become hf.Strategy's arguments only where they differ from its defaults
_STRATEGY_OPTIONS = {
    "recompute": ("recompute", False),
    "blocking": ("overlap_p2p", True),
    "overlap_groups": ("overlap_groups", 1),
    "flat_gradients": ("flat_gradients", True),
    "sync_batchnorm": ("sync_batchnorm", False),
    "tensor": ("tensor", 1),
    "shard_optimizer": ("shard_optimizer", False),
    "by_segment": ("update_by_segment", None),
}


@dataclass(frozen=True)
class Case:
    """One model trained by hf.fit under one layout, to be compared with Keras's own fit.

    `model` and `optimizer` are names the scenario's model module knows (tests/support/models.py
    or zoo.py); `policy` is the Keras dtype policy the model is built under. The layout fields
    are hf.Strategy's; `blocking` posts each receive only when its action needs it
    (overlap_p2p=False). `large_variables` makes every variable count as large (summed per
    variable over micro-batches, flattened once per step, updated in a compiled optimizer call
    of its own); `one_step` trains a single step.
    """

    model: str
    optimizer: str
    kind: str
    partitions: int = 1
    replicas: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    policy: str = "float32"
    recompute: bool = False
    blocking: bool = False
    overlap_groups: int = 1
    flat_gradients: bool = True
    large_variables: bool = False
    sync_batchnorm: bool = False
    one_step: bool = False
    tensor: int = 1
    shard_optimizer: bool = False
    by_segment: bool | None = None  # Strategy(update_by_segment=...)

    def __str__(self) -> str:
        """The readable id: defaults left out, e.g. `mlp-sgd-data-R2`."""
        grid = (
            (f"P{self.partitions}" if self.partitions > 1 else "")
            + (f"R{self.replicas}" if self.replicas > 1 else "")
            + (f"T{self.tensor}" if self.tensor > 1 else "")
        )
        flags = {
            "recompute": self.recompute,
            "blocking": self.blocking,
            f"overlap{self.overlap_groups}": self.overlap_groups > 1,
            "listgrads": not self.flat_gradients,
            "largevars": self.large_variables,
            "syncbn": self.sync_batchnorm,
            "1step": self.one_step,
            "zero": self.shard_optimizer,
            "bysegment": self.by_segment is True,
            "whole": self.by_segment is False,
        }
        parts = [
            self.model,
            self.optimizer,
            self.kind,
            grid,
            f"M{self.microbatches}" if self.microbatches > 1 else "",
            self.schedule if self.schedule != "gpipe" else "",
            self.policy if self.policy != "float32" else "",
            *(name for name, on in flags.items() if on),
        ]
        return "-".join(p for p in parts if p)

    @property
    def id(self) -> str:
        return str(self)

    def strategy_options(self) -> dict:
        """Keyword arguments of hf.Strategy for this case."""
        options = {
            "kind": self.kind,
            "partitions": self.partitions,
            "replicas": self.replicas,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
        }
        for field, (name, default) in _STRATEGY_OPTIONS.items():
            value = getattr(self, field)
            value = not value if field == "blocking" else value
            if value != default:
                options[name] = value
        return options

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

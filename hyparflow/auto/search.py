"""The planner's search: every layout of a world size, each scored, and the fastest that fits.

`strategy="auto"` chooses among partitions x replicas x tensor ranks (their product the world
size), micro-batches, schedule, recomputation and ZeRO-1. This module is the pure part of that
choice: `candidates` lists the layouts a world size and a global batch allow, an estimator gives
each one's step time and peak bytes per rank, and `search` ranks them. The pick is the fastest
layout whose bytes fit the budget; every other layout keeps the reason it lost (out of memory,
refused by the estimator, or slower), so the choice can explain itself. The estimator is where
measured costs, the network and the memory plan come in (`simulate.predict`,
`memory.plan`); here it is any function, so the search is tested in milliseconds. The same
inputs give the same pick on every rank: ties go to the layout with fewer bytes, then to the
simpler one (fewer partitions, tensor ranks and micro-batches).

For example:
    result = search(candidates(4, 64, layers=12), estimate, 64, budget_bytes=8 * 2**30)
    print(result.line())  # the pick, its predicted samples/s and bytes, and the runner-up
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# the schedules searched by default, and those a user may fix under "auto": ZB-H1 is priced
# with an untimed W (half a weighted layer's backward), which picked it wrongly once it was
# searched, and interleaved 1F1B never measured faster than the best pipeline on 2 ranks while
# its price sits within the noise of 1F1B's (docs/auto.md), so the planner chooses neither alone
SCHEDULES = ("gpipe", "1f1b")
PRICED_SCHEDULES = (*SCHEDULES, "zero_bubble", "interleaved")
VIRTUAL_STAGES = 2  # model chunks per stage of an interleaved candidate (Megatron's usual)
OUTRUN = "slower than the pick by its compute alone (not simulated)"
# micro-batch actions of one pass (P x m) the schedule simulator replays for a candidate beyond
# `max_microbatches`: it walks every action in Python, about 30 us each
MOST_ACTIONS = 4096


@dataclass(frozen=True)
class Candidate:
    """One layout: `partitions` x `replicas` x `tensor` ranks, the pipeline's `microbatches`
    and `schedule` (interleaved: `virtual_stages` chunks per stage), `recompute`, ZeRO-1
    (`shard_optimizer`), ZeRO-2 (`shard_gradients`, with `shard_optimizer`) and ZeRO-3
    (`shard_weights`, with both)."""

    partitions: int = 1
    replicas: int = 1
    tensor: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    recompute: bool = False
    shard_optimizer: bool = False
    shard_gradients: bool = False
    shard_weights: bool = False
    virtual_stages: int = 1

    @property
    def world(self) -> int:
        return self.partitions * self.replicas * self.tensor

    def label(self) -> str:
        """Short and unique, e.g. `P2 R2 T1 M4 1f1b zero`."""
        parts = [f"P{self.partitions}", f"R{self.replicas}", f"T{self.tensor}"]
        parts.append(f"M{self.microbatches}")
        if self.partitions > 1:
            parts.append(self.schedule)
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.recompute:
            parts.append("recompute")
        if self.shard_optimizer:
            parts.append(
                "zero3" if self.shard_weights else "zero2" if self.shard_gradients else "zero"
            )
        return " ".join(parts)

    def strategy_options(self) -> dict:
        """Keyword arguments of `hf.Strategy` for this layout."""
        kind = "data" if self.partitions == 1 else "model" if self.replicas == 1 else "hybrid"
        return {
            "kind": kind,
            "partitions": self.partitions,
            "replicas": self.replicas,
            "tensor": self.tensor,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "recompute": self.recompute,
            "shard_optimizer": self.shard_optimizer,
            "shard_gradients": self.shard_gradients,
            "shard_weights": self.shard_weights,
            "virtual_stages": self.virtual_stages,
        }

    def simplicity(self) -> tuple:
        """Sorts simpler layouts first, for ties."""
        return (
            self.partitions,
            self.tensor,
            self.microbatches,
            self.recompute,
            self.shard_optimizer,
            self.shard_gradients,
            self.shard_weights,
            self.virtual_stages,
            self.schedule,
        )


@dataclass(frozen=True)
class Estimate:
    """A layout's predicted step time and the peak bytes of its fullest rank."""

    step_seconds: float
    bytes_per_rank: int


@dataclass(frozen=True)
class Verdict:
    """A candidate, its estimate (None if the estimator refused it) and why it lost (None for
    the pick)."""

    candidate: Candidate
    estimate: Estimate | None
    reason: str | None = None


@dataclass
class SearchResult:
    """The fitting candidates, fastest first (the pick, then the runner-up, ...), and the
    rejected ones with their reasons."""

    global_batch: int
    ranked: list[Verdict] = field(default_factory=list)
    rejected: list[Verdict] = field(default_factory=list)

    @property
    def pick(self) -> Verdict:
        return self.ranked[0]

    @property
    def runner_up(self) -> Verdict | None:
        return self.ranked[1] if len(self.ranked) > 1 else None

    def speedup(self, verdict: Verdict) -> float:
        """How many times `verdict`'s step time the pick's is shorter."""
        return verdict.estimate.step_seconds / self.pick.estimate.step_seconds

    def samples_per_second(self, verdict: Verdict) -> float:
        return self.global_batch / verdict.estimate.step_seconds

    def line(self) -> str:
        """One line: the pick, its predicted samples/s and bytes per rank, and the runner-up."""
        text = f"auto: {self._describe(self.pick)}"
        if self.runner_up is not None:
            text += f"; runner-up {self._describe(self.runner_up)}"
        return text

    def _describe(self, verdict: Verdict) -> str:
        held = size_text(verdict.estimate.bytes_per_rank)
        rate = self.samples_per_second(verdict)
        return f"{verdict.candidate.label()} ({rate_text(rate)} samples/s, {held} per rank)"


# (shard_optimizer, shard_gradients, shard_weights) of a layout with replicas: none, ZeRO-1,
# ZeRO-2, ZeRO-3
SHARDINGS = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))


def candidates(
    world: int,
    global_batch: int,
    *,
    layers: int,
    schedules: Iterable[str] = SCHEDULES,
    max_microbatches: int = 16,
    virtual_stages: int = VIRTUAL_STAGES,
) -> list[Candidate]:
    """Every layout of `world` ranks for `global_batch` samples over a model of `layers` layer
    calls: P x R x T = `world` with at most one stage per layer, micro-batches that split each
    replica's share evenly (powers of two up to `max_microbatches`, and for pipelines P, 2P,
    4P and 8P, Megatron's advice being m >= 4P, while P x m stays within `MOST_ACTIONS`), each
    pipeline under every schedule with and without recompute, and replicas without ZeRO, with
    ZeRO-1 and with ZeRO-2. An interleaved pipeline holds `virtual_stages` chunks a stage
    (P x v at most one per layer; the engine refuses it with tensor ranks)."""
    found = []
    for partitions, replicas, tensor in _factorizations(world):
        if partitions > layers or global_batch % replicas:
            continue
        pipelined = partitions > 1
        options = itertools.product(
            _microbatch_counts(global_batch // replicas, partitions, max_microbatches),
            tuple(schedules) if pipelined else ("gpipe",),
            (False, True) if pipelined else (False,),  # recompute
            SHARDINGS if replicas > 1 else SHARDINGS[:1],
        )
        for *option, sharding in options:
            chunks = virtual_stages if option[1] == "interleaved" else 1
            split_backward = pipelined and option[1] in ("zero_bubble", "interleaved")
            if sharding[2] and split_backward:  # ZeRO-3 runs no such stage (refused)
                continue
            if chunks == 1 or (partitions * chunks <= layers and tensor == 1):
                found.append(Candidate(partitions, replicas, tensor, *option, *sharding, chunks))
    return found


def search(
    layouts: Iterable[Candidate],
    estimate: Callable[[Candidate], Estimate],
    global_batch: int,
    budget_bytes: int | None = None,
    bound: Callable[[Candidate], float] | None = None,
) -> SearchResult:
    """Score every layout with `estimate` (which raises ValueError for a layout it cannot run,
    with the reason) and rank those within `budget_bytes` per rank (None: any), fastest first.
    `bound(candidate)`, if given, is a step time its estimate never goes below: layouts are
    then scored in the order of their bounds, and those whose bound is slower than the
    fastest fitting one so far are rejected unscored (branch and bound; the pick is the same).
    Raises ValueError when none fits, naming the one that needs the fewest bytes."""
    result, best = SearchResult(global_batch), math.inf
    for candidate in sorted(layouts, key=bound) if bound else layouts:
        if bound is not None and bound(candidate) > best:
            result.rejected.append(Verdict(candidate, None, OUTRUN))
            continue
        try:
            guess = estimate(candidate)
        except ValueError as error:
            result.rejected.append(Verdict(candidate, None, str(error)))
            continue
        if budget_bytes is not None and guess.bytes_per_rank > budget_bytes:
            needs, budget = size_text(guess.bytes_per_rank), size_text(budget_bytes)
            reason = f"needs {needs} per rank, over {budget}"
            result.rejected.append(Verdict(candidate, guess, reason))
        else:
            result.ranked.append(Verdict(candidate, guess))
            best = min(best, guess.step_seconds)
    if not result.ranked:
        raise ValueError(_nothing_fits(result.rejected, budget_bytes))
    result.ranked.sort(key=_order)
    for k, verdict in enumerate(result.ranked[1:], start=1):
        slower = result.speedup(verdict) - 1
        result.ranked[k] = Verdict(verdict.candidate, verdict.estimate, f"{slower:.0%} slower")
    return result


def _order(verdict: Verdict) -> tuple:
    guess = verdict.estimate
    return (guess.step_seconds, guess.bytes_per_rank, verdict.candidate.simplicity())


def _nothing_fits(rejected: list[Verdict], budget_bytes: int | None) -> str:
    sized = [v for v in rejected if v.estimate is not None]
    if not sized:
        reasons = "; ".join(f"{v.candidate.label()}: {v.reason}" for v in rejected[:3])
        return f"no layout can run: {reasons}"
    smallest = min(sized, key=lambda v: v.estimate.bytes_per_rank)
    return (
        f"no layout fits {size_text(budget_bytes)} per rank; the smallest, "
        f"{smallest.candidate.label()}, needs {size_text(smallest.estimate.bytes_per_rank)}: "
        "use more ranks or a larger budget"
    )


def _factorizations(world: int) -> list[tuple[int, int, int]]:
    """Every (P, R, T) of positive integers whose product is `world`."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [(p, r, world // (p * r)) for p in divisors for r in divisors if (world // p) % r == 0]


def _microbatch_counts(share: int, partitions: int, most: int) -> list[int]:
    """Micro-batch counts that split `share` samples evenly: powers of two up to `most`, and
    P, 2P, 4P and 8P for a pipeline of P stages within `MOST_ACTIONS`."""
    counts = {1 << k for k in range(most.bit_length())}
    counts |= {partitions * k for k in (1, 2, 4, 8) if partitions * partitions * k <= MOST_ACTIONS}
    return sorted(m for m in counts if m <= share and share % m == 0)


def rate_text(rate: float) -> str:
    """Samples/s with thousands separated, two significant digits below 10 (a large model
    on CPUs trains a fraction of a sample per second).

    Example:
        >>> rate_text(12345.6), rate_text(0.1234)
        ('12,346', '0.12')
    """
    return f"{rate:,.0f}" if rate >= 10 else f"{rate:.2g}"


def size_text(nbytes: int) -> str:
    """Bytes in GiB (2 decimals) from 1 GiB up, else in MiB (1 decimal)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"

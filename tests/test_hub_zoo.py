"""Every keras_hub family of the zoo trains as Keras's own fit does, under real mpirun.

One tiny config per family (tests/support/hub_zoo.py), trained with hf.fit on 2 ranks in three
layouts, data (R=2), pipeline (P=2, 2 micro-batches) and tensor (T=2), against single-process
`model.fit` from the same weights, Adam, `preprocessor=None` (scenario tests/mpi/hub_zoo.py).
`make test` runs `SLICE`, kinds tests/test_real_models.py does not train; `make zoo`
(`HF_ZOO=all`) runs all of them and writes docs/models.md's table (scripts/zoo_table.py) from
the results this module writes to `build/hub_zoo.json`.
"""

from __future__ import annotations

import datetime
import json
import os

import pytest

from tests.support.cases import Case, selected
from tests.support.hub_zoo import BATCHNORM, FAMILIES, LEFT_OUT, REFUSED, hub_families
from tests.support.mpirun import REPO, launch
from tests.support.tolerances import FLOOR_CAP, TOLERANCE, tolerance
from tests.support.zoo_only import ZOO_ENV, full_zoo

# a sequence-to-sequence model, a vision transformer and an image and text model: the last two
# look their position embeddings up with indices broadcast over the batch (issue 62). A causal
# LM and an encoder train in tests/test_real_models.py and tests/test_tensor_parallel.py in
# every layout (GPT-2, Llama, BERT), so GPT2 and Bert run here under `make zoo` only.
SLICE = ("Bart", "ViT", "PaliGemma")
RESULTS_ENV = "HF_ZOO_RESULTS"  # where the results go (default build/hub_zoo.json)
CHUNK = 12  # cases per launch: a job that aborts loses at most the rest of its chunk
LAUNCH_SECONDS = 1200


def layouts(family: str) -> dict[str, Case]:
    """The family's three 2-rank layouts. BatchNormalization is exact with the whole batch's
    statistics only: synchronised across replicas, and a pipeline of one micro-batch."""
    bn = family in BATCHNORM
    optimizer = "sgd" if bn else "adam"  # as hub_zoo.compiled compiles it
    return {
        "data": Case(family, optimizer, "data", replicas=2, sync_batchnorm=bn),
        "pipeline": Case(family, optimizer, "model", partitions=2, microbatches=1 if bn else 2),
        "tensor": Case(family, optimizer, "data", tensor=2),
    }


# HF_ZOO=all: every family; HF_ZOO=ViT,T5: those; unset: the slice
_CHOSEN = os.environ.get(ZOO_ENV, "")
FAMILY_NAMES = list(FAMILIES) if full_zoo() else _CHOSEN.split(",") if _CHOSEN else SLICE
CASES = [case for family in FAMILY_NAMES for case in layouts(family).values()]
LAYOUT = {case.id: name for f in FAMILIES for name, case in layouts(f).items()}


@pytest.fixture(scope="module")
def zoo(request):
    return run_zoo(selected(request, CASES))


def run_zoo(cases: list[Case]) -> dict:
    """Each case's id -> its rank results, launched `CHUNK` cases at a time and saved after
    each launch (a long run stopped early keeps what it measured). A job that ends early (a
    rank left stuck by a failed peer aborts it) charges its first unreported case with the
    ranks' reports and the job's exit, and the cases after it run in the next job."""
    results, pending = {}, list(cases)
    while pending:
        chunk = pending[:CHUNK]
        run = launch("hub_zoo", 2, *(c.to_json() for c in chunk), timeout=LAUNCH_SECONDS)
        reported = _by_case(run.results)
        for case in chunk:
            ranks = reported.get(case.id, [])
            if len(ranks) < 2:
                ranks = ranks + [_lost(run, len(ranks))]
            results[case.id] = ranks
            if "lost" in ranks[-1]:
                break
        pending = pending[len([c for c in chunk if c.id in results]) :]
        save({c.id: results[c.id] for c in chunk if c.id in results})
    return results


def _by_case(rank_results: list) -> dict:
    by_case: dict = {}
    for rank, result in enumerate(rank_results):
        for r in (result or {}).get("results", []):
            by_case.setdefault(r["case"], []).append({"rank": rank, **r})
    return by_case


def _lost(run, rank: int) -> dict:
    tail = run.stderr[rank][-400:] if rank < len(run.stderr) else ""
    return {
        "rank": rank,
        "lost": True,
        "error": f"no report (job ended with {run.returncode}): {tail}",
    }


def save(results: dict) -> None:
    """Merge this run's results into the results file, case by case."""
    path = os.environ.get(RESULTS_ENV) or os.path.join(REPO, "build", "hub_zoo.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    saved = {}
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
    today = datetime.date.today().isoformat()
    for case_id, ranks in results.items():
        family = case_id.split("-")[0]
        saved[case_id] = {
            "family": family,
            "layout": LAYOUT[case_id],
            "date": today,
            "ranks": ranks,
        }
    with open(path, "w") as f:
        json.dump(saved, f, indent=1, sort_keys=True)


def test_the_tolerance_rises_with_the_float_floor_up_to_a_cap():
    assert tolerance(3e-6) == TOLERANCE  # most families: the suite's own
    assert tolerance(9.3e-4) == pytest.approx(3.72e-3)  # Falcon's key biases
    assert tolerance(1.0) == FLOOR_CAP  # no weight is excused an error of 0.4


def test_every_installed_keras_hub_family_is_in_the_zoo_or_left_out_with_a_reason():
    families = hub_families()  # an alias (Qwen2 is Qwen) stands for the family it names
    missing = sorted(f for f, same in families.items() if f == same and f not in FAMILIES)
    assert set(missing) == set(LEFT_OUT), set(missing) ^ set(LEFT_OUT)
    assert all(families.get(f) == f for f in FAMILIES), "a family the installed keras_hub lacks"


@pytest.mark.mpi  # starts MPI jobs
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_keras_hub_family_trains_as_keras_does(zoo, case):
    refusal = REFUSED.get((case.model, LAYOUT[case.id]))
    if refusal is not None:  # refused up front, on every rank, with its reason
        assert all(refusal in r.get("error", "") for r in zoo[case.id]), zoo[case.id]
        return
    for r in zoo[case.id]:
        assert "error" not in r, f"rank {r['rank']}: {r['error']}"
        assert r["history"] < TOLERANCE, f"rank {r['rank']}: History by {r['history']:.2e}"
        assert r["excess"] < 1, (
            f"rank {r['rank']}: weight {r['excess_weight']} is {r['excess']:.1f} times its "
            f"tolerance from Keras (its float floor {r['excess_floor']:.1e}; the worst weight "
            f"{r['worst']} by {r['weights']:.1e})"
        )

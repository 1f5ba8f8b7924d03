"""What `make test` leaves to `make zoo` (docs/testing.md, "What `make test` leaves to `make
zoo`"): cases that repeat a mechanism another case of `make test` tests, on another keras_hub
family or in another layout. `make zoo` sets `HF_ZOO=all` and runs every case; `make test`
runs the others, so that it stays within its time on a 2-core machine."""

from __future__ import annotations

import os

ZOO_ENV = "HF_ZOO"  # "all": every case; "ViT,T5": tests/test_hub_zoo.py's families named

# keras_hub families whose blocks GPT-2, BERT, Llama and the mixtures already test in every
# layout (tied or untied vocabularies, learned or rotary positions, grouped-query attention)
FAMILIES = frozenset({"gemma", "mistral", "roberta", "albert", "falcon", "opt", "distil_bert"})


def full_zoo() -> bool:
    """True under `make zoo`."""
    return os.environ.get(ZOO_ENV) == "all"


def in_this_run(cases: list, left_to_make_zoo: tuple = ()) -> list:
    """`cases` as this run trains them: all under `make zoo`; else without `FAMILIES`' cases
    and the cases in `left_to_make_zoo`."""
    if full_zoo():
        return list(cases)
    return [c for c in cases if c.model not in FAMILIES and c not in left_to_make_zoo]

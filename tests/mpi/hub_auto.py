"""keras_hub's GPT-2 and Llama under hf.fit's default strategy (issue 66): their data is a dict
of unknown lengths, which the planner times at the data's shapes; the pick trains as Keras does.

Usage: `python -m tests.mpi.hub_auto OUT FAMILY...` (hub_zoo's names: GPT2, Llama). The Keras
references are the zoo's (tests/mpi/hub_zoo.py), shared by the session.
"""

import keras
import numpy as np

import hyparflow as hf
from hyparflow.auto.choose import last_choice
from tests.mpi.hub_zoo import request
from tests.support import hub_zoo, references
from tests.support.compare import history_difference, relative_difference
from tests.support.report import args, report, run_or_abort
from tests.support.tolerances import tolerance


def trained(family: str) -> dict:
    """The default strategy's pick for `family` (None: it stayed data parallel) and how far
    the trained weights end from Keras's, each over its tolerance."""
    reference = references.shared(*request(family))
    model = hub_zoo.compiled(family)
    x, y = hub_zoo.data(family, model)
    history = hf.fit(
        model, x, y, batch_size=hub_zoo.BATCH, epochs=hub_zoo.EPOCHS, shuffle=False, verbose=2
    )
    choice = last_choice(model, hf.size())
    pairs = zip(model.weights, reference["weights"], reference["floors"], strict=True)
    excess = [relative_difference([np.asarray(v)], [e]) / tolerance(f) for v, e, f in pairs]
    return {
        "label": choice.result.pick.candidate.label() if choice else None,
        "excess": max(excess),
        "history": history_difference(history.history, reference["history"]),
    }


def main():
    keras.config.disable_interactive_logging()
    families = args()
    references.prefetch([request(family) for family in families])
    found = {}
    for family in families:
        found[family] = trained(family)
        keras.backend.clear_session()
    report(found)


if __name__ == "__main__":
    run_or_abort(main)

"""Train each case (tests/support/zoo.py's models) with hf.fit and with plain Keras; report diffs.

Arguments: cases as JSON (tests/support/cases.py), the optimizer as zoo.optimizer names it
("adam+globalclip"). Every rank trains the Keras reference itself and compares its own copy of
the trained model, which holds the full weights.
"""

import keras

import hyparflow as hf
from tests.support import zoo
from tests.support.cases import Case
from tests.support.compare import history_difference, relative_difference
from tests.support.report import args, report

BATCH, EPOCHS = 16, 2
TRACED = ("_first_fn", "_accumulate_fn", "_forward_fn", "_loss_forward_fn")  # runners' steps


def run(case: Case) -> dict:
    name, optimizer = case.model, case.optimizer
    epochs = 1 if case.one_step else EPOCHS
    if name in zoo.TEXT_MODELS:  # batches of varying sequence length
        x, y, batch_size = zoo.text_batches(name, BATCH), None, None
    else:  # one step: deep networks at tiny sizes amplify float noise step by step
        (x, y), batch_size = zoo.data(name, n=BATCH if case.one_step else 70), BATCH
    reference = zoo.compiled(name, optimizer)
    ref_history = reference.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    )
    model = zoo.compiled(name, optimizer)
    strategy = hf.Strategy(**case.strategy_options())
    history = hf.fit(
        model, x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
        strategy=strategy,
    )  # fmt: skip
    runner = model._hyparflow_trainer[1].runner
    functions = [getattr(runner, name, None) for name in TRACED]
    return {
        "case": case.id,
        # most traces of one compiled step function (Keras's own: 2 for varying lengths)
        "traces": max(f.experimental_get_tracing_count() for f in functions if f is not None),
        "weights": relative_difference(model.get_weights(), reference.get_weights()),
        "history": history_difference(history.history, ref_history.history),
        "keys": sorted(history.history),
        "ref_keys": sorted(ref_history.history),
    }


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    report({"rank": hf.rank(), "results": [run(Case.from_json(c)) for c in args()]})

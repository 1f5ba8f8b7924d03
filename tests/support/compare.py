"""How far a trained model and its History are from the single-process Keras reference."""

import numpy as np


def relative_difference(got, expected) -> float:
    """Largest weight error relative to its tensor's magnitude (tensors below 0.01 count as
    0.01, so near-zero tensors such as fresh biases compare absolutely)."""
    worst = 0.0
    for g, e in zip(got, expected, strict=True):  # a missing weight is an error
        scale = max(float(np.max(np.abs(e))), 1e-2)
        worst = max(worst, float(np.max(np.abs(g - e))) / scale)
    return worst


def history_difference(got: dict, expected: dict) -> float:
    """Largest History error relative to its metric's magnitude; infinite if the keys differ."""
    if set(got) != set(expected):
        return float("inf")
    return max(
        float(np.max(np.abs(np.asarray(got[k]) - np.asarray(expected[k]))))
        / max(1e-6, float(np.max(np.abs(expected[k]))))
        for k in expected
    )


# the runners' compiled steps (engine/stages/fused.py, engine/stages/stage.py)
STEP_FUNCTIONS = (
    "_first_fn",
    "_accumulate_fn",
    "_forward_fn",
    "_loss_forward_fn",
    "_split_forward_fn",
    "_split_loss_forward_fn",
    "_weight_fn",
)


def most_traces(runner, names=STEP_FUNCTIONS) -> int:
    """The most traces of one of `runner`'s compiled functions `names` (or of its segments' or
    interleaved chunks'), with those of its copy traced per length where its relaxed trace
    raised (engine/relaxed.py)."""
    runners = getattr(runner, "segments", None) or getattr(runner, "runners", [runner])
    functions = [(r, getattr(r, name, None)) for r in runners for name in names]
    return max(r._traces.tracing_count(f) for r, f in functions if f is not None)

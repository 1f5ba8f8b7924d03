"""hf.fit as the MPI scenarios call it to compare with a reference run.

Batches in their order (no shuffle: the order Keras's reference fit sees too, and the one a
resumed run replays) and no progress bar in the ranks' output.
"""

from __future__ import annotations

import hyparflow as hf


def fit_in_order(model, x, y, batch_size: int, epochs: int, strategy, **options):
    """hf.fit's History for `model` trained on (x, y) under `strategy`; `options`: hf.fit's
    other keywords (validation_data, comm, resume_from, ...)."""
    return hf.fit(
        model,
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        strategy=strategy,
        **options,
    )

"""Epochs of several hf.fit setups interleaved in one launch, so drift hits them all alike.

Each setup trains its own model object: hyparflow caches one Trainer per model, so switching
one model between strategies would cut stages and trace functions again on every switch.
"""

from __future__ import annotations


def interleaved_epochs(setups: dict, x, y, batch_size: int, repeats: int, steps=None) -> dict:
    """`setups`: name -> (model, strategy or None: `model.fit` on rank 0 while the others wait).
    One warm-up epoch each (tracing), then `repeats` rounds of one epoch each, the order rotated
    every round. Returns name -> epoch seconds (None where a rank waited)."""
    import hyparflow as hf
    from benchmarks.harness.timing import epoch_timer

    def epoch(name):
        model, strategy = setups[name]
        timer = epoch_timer()
        fit = dict(batch_size=batch_size, epochs=1, verbose=0, callbacks=[timer],
                   steps_per_epoch=steps)  # fmt: skip
        if strategy is not None:
            hf.fit(model, x, y, strategy=strategy, **fit)
        else:
            from mpi4py import MPI

            if hf.rank() == 0:
                model.fit(x, y, **fit)
            MPI.COMM_WORLD.Barrier()
        return timer.seconds[0] if timer.seconds else None

    names = list(setups)
    for name in names:
        epoch(name)
    seconds = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(epoch(name))
    return seconds

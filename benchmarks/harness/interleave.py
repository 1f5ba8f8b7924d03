"""Epochs of several hf.fit setups interleaved in one launch, so drift hits them all alike.

Each setup trains its own model object: hyparflow caches one Trainer per model, so switching
one model between strategies would cut stages and trace functions again on every switch.
"""

from __future__ import annotations


def interleaved_epochs(setups: dict, x, y, batch_size: int, repeats: int, steps=None) -> dict:
    """`setups`: name -> (model, strategy). One warm-up epoch each (tracing), then `repeats`
    rounds of one epoch each, the order rotated every round. Returns name -> epoch seconds."""
    import hyparflow as hf
    from benchmarks.harness.timing import epoch_timer

    def epoch(name):
        model, strategy = setups[name]
        timer = epoch_timer()
        hf.fit(model, x, y, batch_size=batch_size, epochs=1, verbose=0, strategy=strategy,
               callbacks=[timer], steps_per_epoch=steps)  # fmt: skip
        return timer.seconds[0]

    names = list(setups)
    for name in names:
        epoch(name)
    seconds = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(epoch(name))
    return seconds

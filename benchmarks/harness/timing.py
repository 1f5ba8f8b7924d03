"""Epoch times: a Keras callback (with the CPU share the process got meanwhile), and epochs of
several hf.fit setups interleaved in one launch, so that drift hits them all alike."""

from __future__ import annotations

import time


def epoch_timer():
    """A callback recording each epoch's wall time and CPU share (built after Keras imports)."""
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds, self.cpu_share = [], []

        def on_epoch_begin(self, epoch, logs=None):
            self._wall, self._cpu = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            wall = time.perf_counter() - self._wall
            self.seconds.append(wall)
            self.cpu_share.append((time.process_time() - self._cpu) / wall)

    return EpochTimer()


def interleaved_epochs(setups: dict, x, y, batch_size: int, repeats: int, steps=None) -> dict:
    """`setups`: name -> (model, strategy or None: `model.fit` on rank 0 while the others wait,
    [a context to enter around that `model.fit`, given the model]), a model object each
    (hyparflow caches one Trainer per model). One warm-up epoch each (tracing), then `repeats`
    rounds of one epoch each, the order rotated every round. Returns name -> epoch seconds (None
    where a rank waited)."""
    import contextlib

    import hyparflow as hf

    def epoch(name):
        model, strategy, *around = setups[name]
        timer = epoch_timer()
        fit = dict(
            batch_size=batch_size, epochs=1, verbose=0, callbacks=[timer], steps_per_epoch=steps
        )
        if strategy is not None:
            hf.fit(model, x, y, strategy=strategy, **fit)
        else:
            from mpi4py import MPI

            if hf.rank() == 0:
                with (around[0] if around else contextlib.nullcontext)(model):
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

"""Keras callbacks that time steps and epochs, and the CPU share a process got meanwhile."""

from __future__ import annotations

import time


def epoch_timer():
    """A callback recording each epoch's wall time and CPU share (built after Keras imports)."""
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds, self.cpu_share, self.step_seconds = [], [], []

        def on_epoch_begin(self, epoch, logs=None):
            self._wall, self._cpu = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            wall = time.perf_counter() - self._wall
            self.seconds.append(wall)
            self.cpu_share.append((time.process_time() - self._cpu) / wall)

        def on_train_batch_begin(self, batch, logs=None):
            self._step = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.step_seconds.append(time.perf_counter() - self._step)

    return EpochTimer()

"""A Keras callback timing each epoch, and the CPU share the process got meanwhile."""

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

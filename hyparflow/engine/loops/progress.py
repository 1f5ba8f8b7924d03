"""Keras's progress bar, shown on rank 0 only, with the global throughput in samples/s."""

from __future__ import annotations

import time

from keras import callbacks

from hyparflow import _keras


class ThroughputProgbarLogger(callbacks.ProgbarLogger):
    """`keras.callbacks.ProgbarLogger` that also displays `samples/s` of the whole job.

    The figure is shown, not logged: History and other callbacks see exactly Keras's logs.
    `hf.fit` counts each global batch with `count(samples)` before the batch's callbacks run.
    """

    def __init__(self):
        super().__init__()
        self._throughput_samples = 0
        self._throughput_start = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._throughput_samples = 0
        self._throughput_start = time.perf_counter()

    def count(self, samples: int) -> None:
        self._throughput_samples += samples

    def _with_throughput(self, logs):
        elapsed = time.perf_counter() - self._throughput_start
        logs = dict(logs or {})
        if elapsed > 0 and self._throughput_samples:
            logs["samples/s"] = self._throughput_samples / elapsed
        return logs

    def on_train_batch_end(self, batch, logs=None):
        _keras.update_progbar(self, batch, self._with_throughput(logs))

    def on_epoch_end(self, epoch, logs=None):
        _keras.finalize_progbar(self, self._with_throughput(logs))

"""Keras's progress bar, shown on rank 0 only, with the global throughput in samples/s."""

from __future__ import annotations

import time

from keras import callbacks


class ThroughputProgbarLogger(callbacks.ProgbarLogger):
    """`keras.callbacks.ProgbarLogger` that also displays `samples/s` of the whole job.

    The figure is shown, not logged: History and other callbacks see exactly Keras's logs.
    `hf.fit` counts each global batch with `count(samples)` before the batch's callbacks run.
    """

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._samples = 0
        self._start = time.perf_counter()

    def count(self, samples: int) -> None:
        self._samples = getattr(self, "_samples", 0) + samples

    def _with_throughput(self, logs):
        elapsed = time.perf_counter() - getattr(self, "_start", time.perf_counter())
        logs = dict(logs or {})
        if elapsed > 0 and getattr(self, "_samples", 0):
            logs["samples/s"] = self._samples / elapsed
        return logs

    def on_train_batch_end(self, batch, logs=None):
        self._update_progbar(batch, self._with_throughput(logs))

    def on_epoch_end(self, epoch, logs=None):
        self._finalize_progbar(self._with_throughput(logs))

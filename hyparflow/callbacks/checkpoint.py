"""`hf.callbacks.Checkpoint`: save the distributed training state every N steps or epoch."""

from __future__ import annotations

import keras

from hyparflow.checkpoint import callback_state, store
from hyparflow.checkpoint import manifest as manifests


class Checkpoint(keras.callbacks.Callback):
    """Save every stage's weights, optimizer state, seed and data position, atomically.

    Each checkpoint is `directory/ckpt-<step>/`: one file per pipeline stage and, written last,
    `manifest.json`; a save cut short by a crash leaves the previous checkpoint loadable. The
    newest `keep` checkpoints are kept. Resume with `hf.fit(..., resume=True)` (this callback's
    directory) or `resume_from=directory`, with the same or another partitioning.

    For example:
        ckpt = hf.callbacks.Checkpoint("checkpoints/", every_n_steps=100)
        hf.fit(model, x, y, epochs=10, callbacks=[ckpt], resume=True, strategy="hybrid", ...)
    """

    needs_batch_logs = False  # its batch hooks neither read the logs nor stop training
    saves_checkpoints = True  # how hf.fit's resume=True finds it (hyparflow.api sits below)

    def __init__(self, directory: str, every_n_steps: int | None = None, every_epoch=True, keep=3):
        super().__init__()
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.directory = directory
        self.every_n_steps = every_n_steps
        self.every_epoch = every_epoch
        self.keep = keep
        self.last_saved = None
        self._trainer = None
        self._epoch = 0
        self._callbacks = []

    def attach_trainer(self, trainer) -> None:
        self._trainer = trainer

    def hold_states_of(self, callbacks: list) -> None:
        """Save these callbacks' state (History, EarlyStopping, ...) with each checkpoint; hf.fit
        runs this callback's epoch end after theirs, so an epoch's checkpoint holds it."""
        self._callbacks = list(callbacks)

    def _require_trainer(self):
        if self._trainer is None:
            raise RuntimeError(
                "hf.callbacks.Checkpoint works inside hf.fit only (pass it to hf.fit, not to "
                "model.fit)."
            )
        return self._trainer

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        trainer = self._require_trainer()
        if self.every_n_steps and trainer.step % self.every_n_steps == 0:
            self.save(self._epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.every_epoch:
            self.save(epoch + 1, 0)

    def save(self, epoch: int, batch: int) -> str:
        """Save now (collective: every rank's callback calls it at the same point)."""
        trainer = self._require_trainer()
        trainer.give_back_weights()  # ZeRO-3: the variables hold values while they are saved
        self.last_saved = store.save(
            trainer.stage_state,
            self.directory,
            epoch=epoch,
            batch=batch,
            keep=self.keep,
            complete=self._complete,
            callbacks=callback_state.capture(self._callbacks),
        )
        return self.last_saved

    def _complete(self, folder: str, manifest) -> None:
        """Write the manifest: the step that makes a checkpoint loadable."""
        manifests.write(folder, manifest)

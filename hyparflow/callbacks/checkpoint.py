"""`hf.callbacks.Checkpoint`: save the distributed training state every N steps or epoch."""

from __future__ import annotations

import keras

from hyparflow.checkpoint import callback_state, store
from hyparflow.checkpoint import manifest as manifests
from hyparflow.launch.preemption import RANK_SIGNALS, Preempted, SignalFlag, signal_name


class Checkpoint(keras.callbacks.Callback):
    """Save every stage's weights, optimizer state, seed and data position, atomically.

    Each checkpoint is `directory/ckpt-<step>/`: one file per pipeline stage and, written last,
    `manifest.json`; a save cut short by a crash leaves the previous checkpoint loadable. The
    newest `keep` checkpoints are kept. Resume with `hf.fit(..., resume=True)` (this callback's
    directory) or `resume_from=directory`, with the same or another partitioning.

    Preemption: while `hf.fit` runs, `preemption_signals` (SIGTERM, and SIGUSR1, which
    `hyparflow run` forwards for a SIGTERM) no longer end the process at once. Every rank
    finishes its step, a checkpoint of that step is saved, and `hf.fit` raises `hf.Preempted`
    on every rank, which exits with status 75 (`hf.PREEMPTED_STATUS`) unless caught. The
    previous handlers come back when `hf.fit` returns. Pass `preemption_signals=()` to leave
    signals alone.

    For example:
        ckpt = hf.callbacks.Checkpoint("checkpoints/", every_n_steps=100)
        hf.fit(model, x, y, epochs=10, callbacks=[ckpt], resume=True, strategy="hybrid", ...)
    """

    needs_batch_logs = False  # its batch hooks neither read the logs nor stop training
    saves_checkpoints = True  # how hf.fit's resume=True finds it (hyparflow.api sits below)

    def __init__(
        self,
        directory: str,
        every_n_steps: int | None = None,
        every_epoch=True,
        keep=3,
        preemption_signals=RANK_SIGNALS,
    ):
        super().__init__()
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.directory = directory
        self.every_n_steps = every_n_steps
        self.every_epoch = every_epoch
        self.keep = keep
        self.preemption_signals = tuple(preemption_signals)
        self.last_saved = None
        self._flag: SignalFlag | None = None
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

    def catching_signals(self) -> SignalFlag:
        """The context `hf.fit` trains in: preemption signals are recorded, not acted on."""
        self._flag = SignalFlag(self.preemption_signals)
        return self._flag

    def on_train_batch_end(self, batch, logs=None):
        trainer = self._require_trainer()
        saved = None
        if self.every_n_steps and trainer.step % self.every_n_steps == 0:
            saved = self.save(self._epoch, batch + 1)
        if self._flag is not None and self.preemption_signals:
            self._stop_if_signalled(trainer, batch, saved)

    def _stop_if_signalled(self, trainer, batch: int, saved: str | None) -> None:
        """Once any rank got a preemption signal, all save this step and raise `Preempted`
        (collective: one small allreduce a step)."""
        if not trainer.agree_any(self._flag.received is not None):
            return
        folder = saved or self.save(self._epoch, batch + 1)
        received = self._flag.received
        cause = signal_name(received) if received is not None else "another rank's signal"
        message = (
            f"hyparflow: preempted ({cause}): saved {folder} after step {trainer.step} (epoch "
            f"{self._epoch + 1}, its batch {batch + 2} next); hf.fit(..., resume=True) goes on "
            "from there"
        )
        if trainer.topology.rank == 0:
            print(message, flush=True)
        raise Preempted(message)

    def on_epoch_end(self, epoch, logs=None):
        if self.every_epoch:
            self.save(epoch + 1, 0)

    def save(self, epoch: int, batch: int) -> str:
        """Save now (collective: every rank's callback calls it at the same point)."""
        trainer = self._require_trainer()
        # ZeRO-3 inside an epoch: each replica saves its slices of the weights, gathering none
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

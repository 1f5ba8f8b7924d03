"""Where `hf.fit(resume=True)` or `resume_from=DIR` continues: which checkpoint, and restoring
it with the Keras callbacks' state, on every rank together (docs/reliability.md, "Resume")."""

from __future__ import annotations

from hyparflow import checkpoint
from hyparflow.comm.agree import agree
from hyparflow.engine.loops.epochs import callbacks_for_rank


def checkpoint_callbacks(fit_kwargs) -> list:
    """The hf.callbacks.Checkpoint callbacks among fit's: by attribute, as hyparflow.callbacks
    sits above (docs/architecture.md)."""
    return [cb for cb in fit_kwargs.get("callbacks") or [] if getattr(cb, "saves_checkpoints", 0)]


def resume_folder(options, fit_kwargs):
    """The checkpoint folder to resume from, or None to start fresh."""
    if options["resume_from"]:
        return checkpoint.find(options["resume_from"], required=True)
    if options["resume"]:
        checkpoints = checkpoint_callbacks(fit_kwargs)
        if not checkpoints:
            raise ValueError(
                "resume=True needs an hf.callbacks.Checkpoint in callbacks (its directory is "
                "where to resume from); or pass resume_from=DIR."
            )
        return checkpoint.find(checkpoints[0].directory, required=False)
    return None


def resume(comm, trainer, folder, kwargs):
    """Restore `folder`'s checkpoint: the epoch and batch to go on at, the callbacks' state
    (without a folder: the user's initial_epoch, nothing restored)."""
    if not folder:
        return kwargs.get("initial_epoch", 0), 0, []
    saved, state = agree(comm, checkpoint.read_checked, folder, trainer.model)
    mine = callbacks_for_rank(kwargs.get("callbacks"), comm.Get_rank())
    agree(comm, checkpoint.check_resumable, mine, saved.callbacks, saved.epoch)
    agree(comm, checkpoint.restore, trainer.stage_state, saved, state)
    trainer.load_shards()  # tensor shards take their pieces of the restored weights
    if kwargs.get("verbose", "auto") != 0 and comm.Get_rank() == 0:
        print(saved.resumed_from(folder), flush=True)
    return saved.epoch, saved.batch, saved.callbacks

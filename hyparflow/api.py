"""fit / evaluate / predict: validate, pick the strategy, run the engine, give weights back."""

from __future__ import annotations

import numpy as np

from hyparflow.comm.world import size, world
from hyparflow.strategy import make_strategy


def _check_compiled(model) -> None:
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The model is not compiled; call model.compile(optimizer=..., loss=...) before hf.fit."
        )


_OWN_STEPS = ("train_step", "test_step", "compute_loss")


def _check_standard_steps(model) -> None:
    """Refuse a model that overrides Keras's step or loss: hf.fit runs its own distributed
    step, so that custom logic would silently not run."""
    import keras

    if getattr(model, "preprocessor", None) is not None and hasattr(model, "preprocess_samples"):
        raise ValueError(
            f"{type(model).__name__} has a preprocessor, which its own fit runs on the data and "
            "hf.fit would not: build the task with preprocessor=None and preprocess the data "
            "first (e.g. dataset.map(preprocessor))."
        )
    for name in _OWN_STEPS:
        if getattr(type(model), name, None) is not getattr(keras.Model, name):
            raise ValueError(
                f"{type(model).__name__} overrides Model.{name}, which hf.fit cannot run across "
                "ranks (it runs its own pipeline step, so the override would be skipped); move "
                "that logic into layers, losses or metrics, or train it with model.fit on one "
                "process."
            )


def _check_random_layers(model, strategy) -> None:
    """Refuse random layers whose draws depend on the batch they see when the global batch is
    cut into pieces (replicas, micro-batches): their results would differ from Keras's."""
    from hyparflow.engine.random_slices import unsliceable_random_layers

    if strategy.replicas * strategy.microbatches == 1:
        return
    names = unsliceable_random_layers(model)
    if names:
        raise ValueError(
            f"Layers {names} draw random numbers that hyparflow cannot split over replicas and "
            "micro-batches as Keras draws them for the whole batch (Dropout and attention "
            "dropout can); apply such augmentation or noise in the input pipeline, or use "
            "one replica and num_microbatches=1."
        )


def _check_batchnorm(model, strategy) -> None:
    """Refuse global-batch BatchNormalization statistics where a pipeline cannot have them: a
    micro-batch is normalised before the later ones reach the layer."""
    from hyparflow.engine.sync_batchnorm import synchronized_layers

    synced = synchronized_layers(model._flatten_layers(), strategy.sync_batchnorm)
    if synced and strategy.microbatches > 1:
        raise ValueError(
            f"BatchNormalization layers {[layer.name for layer in synced][:5]} normalise by the "
            "whole global batch (synchronized=True or sync_batchnorm=True), which micro-batches "
            "cannot see at once; use num_microbatches=1, or let each micro-batch normalise "
            "alone (synchronized=False, sync_batchnorm=False)."
        )


def _check_loss_reductions(model) -> None:
    """The engine weights each micro-batch's mean loss by its share of the global batch, which
    is exact for Keras's default "sum_over_batch_size" reduction."""
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None:
        raise ValueError("The model was compiled without a loss; pass loss=... to compile().")
    from keras import tree

    for loss_fn in tree.flatten(model.loss):
        reduction = getattr(loss_fn, "reduction", "sum_over_batch_size")
        if reduction not in ("sum_over_batch_size", "mean"):
            raise ValueError(
                f"Loss {getattr(loss_fn, 'name', loss_fn)!r} uses reduction {reduction!r}; "
                "multi-rank training needs reduction='sum_over_batch_size' (Keras's default)."
            )


def _build_plan(model, strategy, comm):
    """Partition the model identically on every rank (time-balanced plans are cut on rank 0)."""
    from hyparflow.comm.agree import agree
    from hyparflow.partitioner import partition

    if strategy.partitions == 1:
        return None
    balance = strategy.balance
    if balance == "time":
        plan = agree(comm, lambda: partition(model, strategy.partitions, balance) if
                     comm.Get_rank() == 0 else None)  # fmt: skip
        starts = comm.bcast(
            [s.layers[0] for s in plan.stages[1:]] if plan is not None else None, root=0
        )
        balance = starts
    return agree(comm, partition, model, strategy.partitions, balance)


def _resolve(model, strategy, num_partitions, num_replicas, num_microbatches):
    resolved = make_strategy(strategy, num_partitions, num_replicas, num_microbatches).resolve(
        size()
    )
    _check_compiled(model)
    return resolved


def _shuffle_seed(comm) -> int:
    """A seed drawn on rank 0 (so `keras.utils.set_random_seed` there fixes it) for all ranks."""
    return comm.bcast(int(np.random.randint(2**31 - 1)) if comm.Get_rank() == 0 else None)


_TRAINER_ATTRIBUTE = "_hyparflow_trainer"


def _make_trainer(model, resolved, comm, needs_loss=True, comm_backend=None):
    """This rank's Trainer for `model`, reused by later fit/evaluate/predict calls with the same
    strategy, compilation and gradient-reduction backend (so stages are cut and functions traced
    only once). `comm_backend=None` (evaluate, predict: no gradients) takes any cached one."""
    from hyparflow.comm.agree import agree
    from hyparflow.engine.trainer import Trainer

    if needs_loss:
        agree(comm, _check_loss_reductions, model)
        agree(comm, _check_standard_steps, model)
    agree(comm, _check_random_layers, model, resolved)
    agree(comm, _check_batchnorm, model, resolved)
    cached = getattr(model, _TRAINER_ATTRIBUTE, None)
    if comm_backend is None:
        comm_backend = cached[0][-1] if cached is not None else "mpi"
    key = (
        repr(resolved),
        id(getattr(model, "optimizer", None)),
        id(getattr(model, "_compile_loss", None)),
        comm.Get_size(),
        comm_backend,
    )
    if cached is not None and cached[0] == key:
        return cached[1]
    if cached is not None:
        cached[1].close()
    if comm.Get_size() > 1:
        from hyparflow.comm.topology import Grid
        from hyparflow.launch.affinity import pin_if_oversubscribed
        from hyparflow.launch.malloc import keep_temporaries_in_heap

        keep_temporaries_in_heap()  # ranks share nodes: no page faults on every step's temporaries
        # more ranks than cores: a rank's threads on one core, stages mixed on each core
        stage, _ = Grid(resolved.partitions, resolved.replicas).coords(comm.Get_rank())
        pin_if_oversubscribed(comm, stage)
    # The partitioner rejects models that are not graphs, naming strategy="data" as the fix.
    plan = _build_plan(model, resolved, comm)
    trainer = Trainer(model, resolved, comm, plan, comm_backend=comm_backend)
    object.__setattr__(model, _TRAINER_ATTRIBUTE, (key, trainer))  # not a tracked attribute
    return trainer


def _run(comm, work, model=None):
    """Run a collective loop. Errors raised on every rank at the same point (agreed) propagate.
    Another error mid-step propagates too if every rank fails within `all_failed`'s wait (the
    same error everywhere, e.g. a trace that cannot be built: `model`'s trainer, whose messages
    may be half-sent, is dropped); otherwise some rank is blocked in MPI, so the job ends."""
    from hyparflow.comm.agree import (
        AgreedError,
        abort_on_error,
        all_failed,
        failure_comm,
        is_agreed,
    )

    failures = failure_comm(comm)  # collective: before any rank can fail
    try:
        return work()
    except Exception as error:  # noqa: BLE001
        if is_agreed(error):
            raise
        if all_failed(failures, error):
            _drop_trainer(model)
            raise AgreedError(error) from None
        abort_on_error(comm, error, "training step")


def _drop_trainer(model) -> None:
    """Forget `model`'s trainer after a failed step: the next call builds a fresh one (new
    communicators, so nothing left of the failed step can be received by mistake)."""
    cached = getattr(model, _TRAINER_ATTRIBUTE, None) if model is not None else None
    if cached is not None:
        cached[1].watchdog.close()
        object.__delattr__(model, _TRAINER_ATTRIBUTE)


def fit(
    model,
    x=None,
    y=None,
    *,
    batch_size=None,
    epochs=1,
    strategy="auto",
    num_partitions=None,
    num_replicas=None,
    num_microbatches=None,
    resume=False,
    resume_from=None,
    check_numerics=False,
    watchdog_timeout=None,
    comm="mpi",
    **fit_kwargs,
):
    """Train `model` like `model.fit`, spread over the MPI ranks by `strategy`.

    Accepts every keyword of `keras.Model.fit` (validation_data, validation_split, callbacks,
    shuffle, verbose, sample_weight, class_weight, initial_epoch, steps_per_epoch, ...) and
    returns a `keras.callbacks.History`, identical on every rank. Without a launcher (world size
    1) this is exactly `model.fit`. Under `mpirun -np N`, `strategy` is "data", "model",
    "hybrid" or "auto" (or an `hf.Strategy`), with HyPar-Flow's `num_partitions`,
    `num_replicas` and `num_microbatches`. When it returns, every rank's `model` holds the
    trained weights (optimizer state stays with the stage that owns each variable).

    Reliability options: `resume=True` continues from the latest checkpoint of the
    `hf.callbacks.Checkpoint` among `callbacks` (or starts fresh if there is none);
    `resume_from=DIR` continues from DIR's latest checkpoint (which must exist), with any
    partitioning. `check_numerics=True` stops every rank on NaN/Inf data, loss or gradients.
    `watchdog_timeout` (seconds, default $HYPARFLOW_WATCHDOG_TIMEOUT or 300; 0 disables) ends
    the job when a rank waits on MPI longer than that.

    `comm` picks how gradients are summed across replicas: "mpi" (hyparflow's fused buckets,
    the default) or "horovod" (Horovod's grouped allreduce; Horovod must be built, see
    docs/horovod.md). Point-to-point pipeline traffic always goes over MPI.

    Example:
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        >>> history = hf.fit(model, x, y, batch_size=64, epochs=3,
        ...                  strategy="hybrid", num_partitions=2, num_replicas=2)
    """
    resolved = _resolve(model, strategy, num_partitions, num_replicas, num_microbatches)
    options = dict(
        resume=resume, resume_from=resume_from, check_numerics=check_numerics,
        watchdog_timeout=watchdog_timeout, comm=_check_comm(comm),
    )  # fmt: skip
    needs_engine = resume or resume_from or check_numerics or _checkpoints(fit_kwargs)
    if size() == 1 and not needs_engine:
        # One rank, one partition, one replica: the embedded default is plain Keras.
        if hasattr(x, "as_keras"):  # hyparflow readers (hf.data.HDF5) as a Keras PyDataset
            x = x.as_keras(
                batch_size=batch_size or 32,
                shuffle=fit_kwargs.pop("shuffle", True),
                seed=int(np.random.randint(2**31 - 1)),
            )
            batch_size = None
            fit_kwargs["shuffle"] = False  # the reader shuffles samples itself
        return model.fit(x, y, batch_size=batch_size, epochs=epochs, **fit_kwargs)
    return _distributed_fit(model, x, y, batch_size, epochs, resolved, options, **fit_kwargs)


def _check_comm(backend: str) -> str:
    """The gradient-reduction backend, checked on every rank (a rank without Horovod stops all)."""
    from hyparflow.comm.agree import agree
    from hyparflow.comm.backends import check_backend
    from hyparflow.comm.world import launched

    if not launched():  # one process: no MPI to start (see comm/world.py)
        return check_backend(backend)
    return agree(world(), check_backend, backend)


_FIT_KEYS = {
    "verbose", "callbacks", "validation_split", "validation_data", "shuffle", "class_weight",
    "sample_weight", "initial_epoch", "steps_per_epoch", "validation_steps",
    "validation_batch_size", "validation_freq",
}  # fmt: skip


def _checkpoints(fit_kwargs) -> list:
    from hyparflow.callbacks.checkpoint import Checkpoint

    return [cb for cb in fit_kwargs.get("callbacks") or [] if isinstance(cb, Checkpoint)]


def _resume_folder(options, fit_kwargs):
    """The checkpoint folder to resume from, or None to start fresh."""
    from hyparflow.checkpoint import find

    if options["resume_from"]:
        return find(options["resume_from"], required=True)
    if options["resume"]:
        checkpoints = _checkpoints(fit_kwargs)
        if not checkpoints:
            raise ValueError(
                "resume=True needs an hf.callbacks.Checkpoint in callbacks (its directory is "
                "where to resume from); or pass resume_from=DIR."
            )
        return find(checkpoints[0].directory, required=False)
    return None


def _check_inputs(model, x, check_numerics: bool, *arrays) -> None:
    """Refuse inputs whose shapes the model cannot take, and NaN/Inf when asked to check."""
    from hyparflow.engine.trainer import model_input_list

    if isinstance(x, np.ndarray | list | tuple | dict) and getattr(model, "inputs", None):
        given = model_input_list(model, x)
        if len(given) == len(model.inputs):
            for array, expected in zip(given, model.inputs):
                shape, want = tuple(np.shape(array))[1:], tuple(expected.shape)[1:]
                if len(shape) != len(want) or any(
                    w is not None and w != s for s, w in zip(shape, want)
                ):
                    raise ValueError(
                        f"Input of shape {tuple(np.shape(array))} does not fit the model input "
                        f"{expected.name!r} of shape {tuple(expected.shape)}; reshape the data "
                        "or build the model for it."
                    )
    if check_numerics:
        from keras import tree

        for array in tree.flatten([x, *arrays]):
            a = np.asarray(array) if array is not None else None
            if a is not None and a.dtype.kind == "f" and not np.all(np.isfinite(a)):
                raise ValueError(
                    f"The data holds NaN or Inf ({int(np.sum(~np.isfinite(a)))} values in an "
                    f"array of shape {a.shape}); clean it, or pass check_numerics=False."
                )


def _distributed_fit(model, x, y, batch_size, epochs, resolved, options, **kwargs):
    from hyparflow import checkpoint
    from hyparflow.comm.agree import agree
    from hyparflow.comm.watchdog import resolve_timeout
    from hyparflow.data import check_divisible, make_source, unpack
    from hyparflow.engine.loops import fit_loop

    comm = world()
    unknown = set(kwargs) - _FIT_KEYS
    if unknown:
        raise TypeError(f"hf.fit got unexpected keyword arguments {sorted(unknown)}")
    sample_weight = kwargs.get("sample_weight")
    timeout = agree(comm, resolve_timeout, options["watchdog_timeout"])
    folder = agree(comm, _resume_folder, options, kwargs)
    manifest = agree(comm, checkpoint.store.manifests.read, folder) if folder else None
    seed = manifest.seed if manifest else _shuffle_seed(comm)

    def prepare():
        nonlocal x, y, sample_weight
        validation_data = kwargs.get("validation_data")
        split = kwargs.get("validation_split", 0.0)
        if split and validation_data is None:
            from keras.src.trainers.data_adapters.array_slicing import train_validation_split

            (x, y, sample_weight), validation_data = train_validation_split(
                (x, y, sample_weight), validation_split=split
            )
        class_weight = kwargs.get("class_weight")
        if class_weight is not None:
            from keras.src.trainers.data_adapters.data_adapter_utils import (
                class_weight_to_sample_weights,
            )

            weights = class_weight_to_sample_weights(np.asarray(y), class_weight)
            sample_weight = weights if sample_weight is None else sample_weight * weights
        _check_inputs(model, x, options["check_numerics"], y, sample_weight)
        source = make_source(
            x, y, sample_weight, batch_size=batch_size, shuffle=kwargs.get("shuffle", True),
            seed=seed,
        )  # fmt: skip
        if hasattr(source, "batch_size"):
            check_divisible(source.batch_size, resolved.replicas, resolved.microbatches)
        validation_source = None
        if validation_data is not None:
            vx, vy, vsw = (
                (validation_data, None, None)
                if hasattr(validation_data, "as_source")
                else unpack(tuple(validation_data))
            )
            validation_source = make_source(
                vx, vy, vsw, batch_size=kwargs.get("validation_batch_size") or batch_size
            )
        return source, validation_source

    source, validation_source = agree(comm, prepare)
    trainer = _make_trainer(model, resolved, comm, comm_backend=options["comm"])
    trainer.use_watchdog(timeout)
    trainer.check_numerics = options["check_numerics"]
    trainer.seed = seed
    initial_epoch, start_batch = kwargs.get("initial_epoch", 0), 0
    if folder:
        saved, state = agree(comm, checkpoint.read_checked, folder, model)
        agree(comm, checkpoint.restore, trainer, saved, state)
        initial_epoch, start_batch = saved.epoch, saved.batch
    return _run(
        comm,
        model=model,
        work=lambda: fit_loop(
            trainer,
            source,
            epochs=epochs,
            initial_epoch=initial_epoch,
            start_batch=start_batch,
            steps_per_epoch=kwargs.get("steps_per_epoch"),
            callbacks=kwargs.get("callbacks"),
            verbose=kwargs.get("verbose", "auto"),
            validation_source=validation_source,
            validation_steps=kwargs.get("validation_steps"),
            validation_freq=kwargs.get("validation_freq", 1),
        ),
    )


def evaluate(
    model, x=None, y=None, *, batch_size=None, sample_weight=None, steps=None, callbacks=None,
    return_dict=False, verbose="auto", strategy="auto", num_partitions=None, num_replicas=None,
    num_microbatches=None,
):  # fmt: skip
    """Loss and metrics of `model` on the data, like `model.evaluate`, on every strategy.

    Example:
        >>> loss, accuracy = hf.evaluate(model, x_test, y_test, batch_size=128, strategy="model")
    """
    resolved = _resolve(model, strategy, num_partitions, num_replicas, num_microbatches)
    if size() == 1:
        if hasattr(x, "as_keras"):
            x, batch_size = x.as_keras(batch_size=batch_size or 32), None
        return model.evaluate(
            x, y, batch_size=batch_size, sample_weight=sample_weight, steps=steps,
            callbacks=callbacks, return_dict=return_dict, verbose=verbose,
        )  # fmt: skip
    from hyparflow.comm.agree import agree
    from hyparflow.data import make_source
    from hyparflow.engine.loops import evaluate_loop

    comm = world()
    source = agree(comm, make_source, x, y, sample_weight, batch_size=batch_size)
    trainer = _make_trainer(model, resolved, comm)
    logs = _run(comm, lambda: evaluate_loop(trainer, source, steps=steps), model)
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def predict(
    model, x, *, batch_size=None, steps=None, verbose="auto", strategy="auto",
    num_partitions=None, num_replicas=None, num_microbatches=None,
):  # fmt: skip
    """The model's outputs for `x`, like `model.predict`, identical on every rank.

    Example:
        >>> probabilities = hf.predict(model, x_test, batch_size=256, strategy="model")
    """
    resolved = make_strategy(strategy, num_partitions, num_replicas, num_microbatches).resolve(
        size()
    )
    if size() == 1:
        if hasattr(x, "as_keras"):
            x, batch_size = x.as_keras(batch_size=batch_size or 32), None
        return model.predict(x, batch_size=batch_size, steps=steps, verbose=verbose)
    from hyparflow.comm.agree import agree
    from hyparflow.data import make_source
    from hyparflow.engine.loops import predict_loop

    comm = world()
    source = agree(comm, make_source, x, batch_size=batch_size)
    trainer = _make_trainer(model, resolved, comm, needs_loss=False)
    return _run(comm, lambda: predict_loop(trainer, source, steps=steps), model)

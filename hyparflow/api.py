"""fit / evaluate / predict: validate, pick the strategy, run the engine, give weights back."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import numpy as np

from hyparflow import _keras, checkpoint, deferred, devices, model_checks
from hyparflow.auto.choose import Request, last_choice, planned_strategy
from hyparflow.comm.agree import AgreedError, agree, failure_comm, is_agreed
from hyparflow.comm.backends import check_backend
from hyparflow.comm.failure import run_collectively
from hyparflow.comm.topology import Grid, placed
from hyparflow.comm.watchdog import resolve_timeout
from hyparflow.comm.world import launched, loops_comm, rank, retire_loops_comm, size, world
from hyparflow.data import make_source
from hyparflow.data.fingerprint import data_digest, differing_ranks, mismatch_message
from hyparflow.data.sources import (
    fit_sources,
    input_arrays,
    input_shapes,
    nominal_batch_size,
    split_validation,
)
from hyparflow.engine.custom_step import make_trainer
from hyparflow.engine.keras_semantics.sparse_probe import probe_row_kinds
from hyparflow.engine.loops.epochs import evaluate_loop, fit_loop, predict_loop
from hyparflow.engine.stages.agreed_plan import agreed_plan
from hyparflow.engine.trainer import give_back_after_failure
from hyparflow.engine.weights import held_elsewhere
from hyparflow.launch.origin import relaunch_command
from hyparflow.memory.one_process import check_fits_one_process
from hyparflow.moe.in_keras import sparse_in_keras
from hyparflow.partitioner import partition as _partition
from hyparflow.process_tuning import tune_process
from hyparflow.resume import checkpoint_callbacks, resume, resume_folder
from hyparflow.spelling import Spelling
from hyparflow.strategy import make_strategy
from hyparflow.tensor import rules as tensor_rules


def _resolve(model, strategy, num_partitions, num_replicas, num_microbatches, compiled=True):
    """The strategy for this world, checked on every rank together: a bad argument is then an
    agreed error, which ends each rank by itself (no abort; comm/uncaught.py)."""

    def resolve():
        requested = make_strategy(strategy, num_partitions, num_replicas, num_microbatches)
        if compiled:
            model_checks.check_compiled(model)
        # an open "auto": the layout fit last planned (fit plans again, knowing the batch)
        chosen = last_choice(model, size()) if requested.leaves_layout_open() else None
        spelling = Spelling.of(isinstance(strategy, str), relaunch_command(os.environ))
        return chosen.strategy if chosen else requested.resolve(size(), spelling)

    return agree(world(), resolve) if size() > 1 else resolve()


def _shuffle_seed(comm) -> int:
    """A seed drawn on rank 0 (so `keras.utils.set_random_seed` there fixes it) for all ranks."""
    return comm.bcast(int(np.random.randint(2**31 - 1)) if comm.Get_rank() == 0 else None)


_TRAINER_ATTRIBUTE = "_hyparflow_trainer"


def partition(
    model,
    num_partitions: int = 1,
    balance="layers",
    *,
    tensor: int = 1,
    tensor_layout=None,
    **options,
):
    """Split `model` into `num_partitions` pipeline stages (`hyparflow.partitioner.partition`,
    whose `options` it takes) and, with `tensor=T` > 1, each stage's layers over T tensor ranks
    as hf.fit would (`tensor_layout`: Strategy's override): `summary()` then also shows which
    layers split which way, what stays whole and why, and the bytes each rank holds.

    For example:
        print(hf.partition(model, 2, tensor=2).summary(print_fn=None))
    """
    uncut = tensor_rules.pair_cuts if tensor > 1 else None
    plan = _partition(model, num_partitions, balance, uncut=uncut, **options)
    if tensor > 1:
        plan.tensor_layouts = _stage_layouts(model, plan, tensor, tensor_layout)
    return plan


def _stage_layouts(model, plan, tensor: int, overrides) -> list:
    """Each pipeline stage's tensor layout over `tensor` ranks (the whole model's when `plan`
    is None). hf.fit computes every stage's on every rank, so a layer that T does not divide is
    refused everywhere alike."""
    graphs = [model] if plan is None else [stage.model for stage in plan.stages]
    return [tensor_rules.tensor_layout(graph, tensor, overrides) for graph in graphs]


def _make_trainer(
    model, resolved, comm, needs_loss=True, comm_backend=None, restoring=False, inputs=None
):
    """This rank's Trainer for `model`, reused by later fit/evaluate/predict calls with the same
    strategy, compilation and gradient-reduction backend (so stages are cut and functions traced
    only once). `comm_backend=None` (evaluate, predict: no gradients) takes any cached one.
    `restoring`: a checkpoint will be restored into the trainer (resume). `inputs`: the
    data's input arrays, if any (their shapes are where the model's gradient is probed)."""
    if needs_loss:
        agree(comm, model_checks.check_loss_reductions, model)
        agree(comm, model_checks.check_standard_steps, model, resolved)
        agree(comm, model_checks.check_router_losses, model, resolved)
    agree(comm, model_checks.check_random_layers, model, resolved)
    agree(comm, model_checks.check_batchnorm, model, resolved)
    cached = getattr(model, _TRAINER_ATTRIBUTE, None)
    if comm_backend is None:
        comm_backend = cached[0][-1] if cached is not None else "mpi"
    key = (
        repr(resolved),
        id(getattr(model, "optimizer", None)),
        id(_keras.compiled_loss(model)),
        comm.Get_size(),
        comm_backend,
    )
    if cached is not None and cached[0] == key:
        cached[1].load_shards()
        return cached[1]
    if cached is not None:
        cached[1].close()
    grid = Grid(resolved.partitions, resolved.replicas, resolved.tensor)
    comm = placed(comm, grid)  # tensor groups inside nodes, replicas across (comm/placement.py)
    stage, _ = grid.coords(comm.Get_rank())
    if resolved.tune_process and comm.Get_size() > 1:  # the user opted in (Strategy docs)
        tune_process(comm, stage)
    # The partitioner rejects models that are not graphs, naming strategy="data" as the fix.
    plan = agreed_plan(model, resolved, comm)
    layout = None
    agree(comm, model_checks.check_optimizer_unbuilt, model, resolved)
    if resolved.tensor > 1:
        layouts = agree(comm, _stage_layouts, model, plan, resolved.tensor, resolved.tensor_layout)
        layout = layouts[stage]
    if deferred.any_deferred(model):  # built under hf.scope(): allocate this rank's share only
        elsewhere = held_elsewhere(model, plan, stage, layout, resolved.experts)
        if _allocates_slices_only(resolved):  # ZeRO-3: the trainer allocates its slices
            elsewhere += list(model.trainable_variables)
        agree(comm, _materialize_share, model, elsewhere, restoring)
    agree(comm, model_checks.check_sample_coupling, model, resolved, inputs)
    # which variables' gradients are row slices, per sample or per batch (refused: both)
    row_kinds = agree(comm, probe_row_kinds, model, inputs)
    trainer = make_trainer(
        model,
        resolved,
        comm,
        plan,
        comm_backend=comm_backend,
        tensor_layout=layout,
        row_kinds=row_kinds,
    )
    object.__setattr__(model, _TRAINER_ATTRIBUTE, (key, trainer))  # not a tracked attribute
    return trainer


def _allocates_slices_only(resolved) -> bool:
    """Whether a model built under hf.scope() keeps its trainable variables unallocated for
    the trainer, which gives each rank its slices of them alone (ZeRO-3 over replicas, with
    no tensor or expert shards, whose pieces are cut from the whole variables)."""
    sliced = resolved.shard_weights and resolved.replicas > 1
    return sliced and resolved.tensor == 1 and resolved.experts == 1


_SHARE_TRAINED = "_hyparflow_share_trained"


def _materialize_share(model, keep_deferred, restoring: bool) -> None:
    """Allocate this rank's share of a model built under hf.scope(). Once hf.fit has trained
    it, a weight never held here would start from its initial value: refused unless a
    checkpoint is restored into it."""
    if getattr(model, _SHARE_TRAINED, False) and not restoring:
        keep = {id(v) for v in keep_deferred}
        new = [v.path for v in model.weights if deferred.is_deferred(v) and id(v) not in keep]
        if new:
            raise ValueError(
                f"This rank would need weights it never held ({new[:3]}): the model was built "
                "under hf.scope() and trained with another layout, so its weights are spread "
                "over the ranks that trained them. Keep the layout, or continue from a "
                "checkpoint with resume_from=... (hf.callbacks.Checkpoint saves one)."
            )
    deferred.materialize_model(model, keep_deferred=keep_deferred)
    object.__setattr__(model, _SHARE_TRAINED, True)  # not a tracked attribute


def _run(comm, work, model=None):
    """Run a collective loop: an error on any rank is raised on every rank (comm/failure.py);
    `model`'s trainer, whose messages may be half-sent, is then dropped. Under ZeRO-3 the
    model's variables first get their values back from the slices (`_give_back_weights`),
    and the next loop runs on a fresh communicator (`retire_loops_comm`)."""

    def recover():
        _give_back_weights(comm, model)
        _drop_trainer(model)
        retire_loops_comm()  # a rank may have left a collective on it half-entered

    try:
        return run_collectively(comm, work, on_failure=recover)
    except Exception as error:
        if is_agreed(error):  # raised at one point everywhere, or after `recover`
            _give_back_weights(comm, model)
        raise


def _give_back_weights(comm, model) -> None:
    """After a failed step on every rank: ZeRO-3's variables take their values from the slices,
    over a duplicate of `comm` that the step did not use (collective over `comm`'s ranks;
    nothing where no trainer holds slices)."""
    cached = getattr(model, _TRAINER_ATTRIBUTE, None) if model is not None else None
    if cached is None:
        give_back_after_failure(failure_comm(comm))  # the others may hold slices
    else:
        cached[1].give_back_weights_after_failure(failure_comm(comm))


def _drop_trainer(model) -> None:
    """Forget `model`'s trainer after a failed step: the next call builds a fresh one (new
    communicators, so nothing left of the failed step can be received by mistake)."""
    cached = getattr(model, _TRAINER_ATTRIBUTE, None) if model is not None else None
    if cached is not None:
        cached[1].guard.close()
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
    check_data=True,
    watchdog_timeout=None,
    comm="mpi",
    **fit_kwargs,
):
    """Train `model` like `model.fit`, spread over the MPI ranks by `strategy`.

    Accepts every keyword of `keras.Model.fit` (validation_data, validation_split, callbacks,
    shuffle, verbose, sample_weight, class_weight, initial_epoch, steps_per_epoch, ...) and
    returns a `keras.callbacks.History`, identical on every rank. Without a launcher (world size
    1) this is `model.fit` itself, keras_hub's mixture-of-experts blocks computing each token
    through its top-k experts only (docs/moe.md; `Strategy(sparse_experts=False)`: exactly
    `model.fit`). Under `mpirun -np N`, `strategy` is "data", "model",
    "hybrid" or "auto" (or an `hf.Strategy`), with HyPar-Flow's `num_partitions`,
    `num_replicas` and `num_microbatches`. "auto" without a layout times the model on rank 0,
    probes the network and trains with the fastest layout that fits the memory budget; rank 0
    prints which (docs/auto.md). When it returns, every rank's `model` holds the
    trained weights (and rank 0's `model.save` writes the whole optimizer state); a model
    built under `hf.scope()` keeps only the weights of each rank's own stage and tensor shard
    (others raise `hf.NotHeldError`; `hf.export` writes the whole model from a checkpoint).

    Reliability options: `resume=True` continues from the latest checkpoint of the
    `hf.callbacks.Checkpoint` among `callbacks` (or starts fresh if there is none);
    `resume_from=DIR` continues from DIR's latest checkpoint (which must exist), with any
    partitioning and any number of ranks: the strategy is resolved for the ranks there are
    ("auto" plans again), and `batch_size`, the global batch, stays the same. While it trains,
    a Checkpoint callback takes SIGTERM as preemption: every rank saves the current step and
    `hf.Preempted` (exit status 75) is raised (docs/reliability.md).
    `check_numerics=True` stops every rank on NaN/Inf data, loss or gradients.
    `check_data` (default True) compares a digest of the data across ranks before training
    (data/fingerprint.py): each rank reads its share from its own copy, so the copies must match.
    `watchdog_timeout` (seconds, default $HYPARFLOW_WATCHDOG_TIMEOUT or 300; 0 disables) ends
    the job when a rank waits on MPI longer than that.

    `comm` picks how gradients are summed across replicas: "mpi" (hyparflow's fused buckets,
    the default) or "horovod" (Horovod's grouped allreduce; Horovod must be built, see
    docs/horovod.md). Point-to-point pipeline traffic always goes over MPI.

    For example:
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        history = hf.fit(model, x, y, batch_size=64, epochs=3,
                         strategy="hybrid", num_partitions=2, num_replicas=2)
    """
    resolved = _resolve(model, strategy, num_partitions, num_replicas, num_microbatches)
    options = dict(
        resume=resume,
        resume_from=resume_from,
        check_numerics=check_numerics,
        check_data=check_data,
        watchdog_timeout=watchdog_timeout,
        comm=_check_comm(comm),
    )
    needs_engine = resume or resume_from or check_numerics or checkpoint_callbacks(fit_kwargs)
    if size() == 1 and not needs_engine:
        # One rank, one partition, one replica: the embedded default is plain Keras.
        if deferred.any_deferred(model):  # built under hf.scope(): all of it here, if it fits
            check_fits_one_process(model, batch_size)
            deferred.materialize_model(model)
        if hasattr(x, "as_keras"):  # hyparflow readers (hf.data.HDF5) as a Keras PyDataset
            x = x.as_keras(
                batch_size=batch_size or 32,
                shuffle=fit_kwargs.pop("shuffle", True),
                seed=int(np.random.randint(2**31 - 1)),
            )
            batch_size = None
            fit_kwargs["shuffle"] = False  # the reader shuffles samples itself
        _say_layout(model, resolved, fit_kwargs)
        with sparse_in_keras(model, resolved.sparse_experts):
            return model.fit(x, y, batch_size=batch_size, epochs=epochs, **fit_kwargs)
    requested = make_strategy(strategy, num_partitions, num_replicas, num_microbatches)
    options["planning"] = requested if requested.leaves_layout_open() and size() > 1 else None
    return _distributed_fit(model, x, y, batch_size, epochs, resolved, options, **fit_kwargs)


def _say_layout(model, resolved, fit_kwargs) -> None:
    """Rank 0's one line about what runs besides the layout the user named, unless
    `verbose=0` (model_checks.layout_notice)."""
    notice = model_checks.layout_notice(model, resolved)
    if notice and fit_kwargs.get("verbose", "auto") != 0 and rank() == 0:
        print(notice, flush=True)


def _say_whole_gradients(trainer, resolved, fit_kwargs) -> None:
    """Rank 0's line where `shard_gradients` asked for what some stage cannot do: it is not
    cut into segments, so its gradients are whole until its backward ends (collective)."""
    if not (resolved.shard_gradients and resolved.replicas > 1):
        return
    whole = trainer.agree_any(not trainer.shards_gradients)
    if whole and fit_kwargs.get("verbose", "auto") != 0 and rank() == 0:
        print(
            "hyparflow: shard_gradients: a stage could not be cut into segments (a subclassed "
            "model, tensor or expert shards, or layers shared by stages); its gradients are "
            "reduce-scattered after its backward, as shard_optimizer=True does (docs/zero.md)",
            flush=True,
        )


def _check_comm(backend: str) -> str:
    """The gradient-reduction backend, checked on every rank (a rank without Horovod stops all)."""
    if not launched():  # one process: no MPI to start (see comm/world.py)
        return check_backend(backend)
    return agree(world(), check_backend, backend)


_FIT_KEYS = {
    "verbose",
    "callbacks",
    "validation_split",
    "validation_data",
    "shuffle",
    "class_weight",
    "sample_weight",
    "initial_epoch",
    "steps_per_epoch",
    "validation_steps",
    "validation_batch_size",
    "validation_freq",
}


def _check_same_data(comm, digest: str | None) -> None:
    """Every rank's data must match (one small allgather); else the same error on every rank."""
    groups = differing_ranks(comm.allgather(digest))
    if len(groups) > 1:
        raise AgreedError(ValueError(mismatch_message(groups)))


def _planned(comm, model, source, options, fit_kwargs):
    """The layout the planner picks for `options["planning"]`, an open "auto" strategy."""
    refusal = functools.partial(model_checks.check_layout, model, comm_backend=options["comm"])
    request = Request(
        options["planning"], nominal_batch_size(source), refusal, input_shapes(source)
    )
    return planned_strategy(comm, model, request, say=fit_kwargs.get("verbose", "auto") != 0)


def _check_fit_keys(fit_kwargs) -> None:
    unknown = set(fit_kwargs) - _FIT_KEYS
    if unknown:
        raise TypeError(f"hf.fit got unexpected keyword arguments {sorted(unknown)}")


def _distributed_fit(model, x, y, batch_size, epochs, resolved, options, **kwargs):
    """hf.fit on more than one rank; `options["planning"]`: an open "auto" strategy to plan
    the layout from (None: `resolved` is the layout)."""
    comm = loops_comm()
    agree(comm, _check_fit_keys, kwargs)
    devices.prepare(comm, resolved.bind_gpus)  # one GPU per rank; CUDA-aware MPI or staging
    timeout = agree(comm, resolve_timeout, options["watchdog_timeout"])
    folder = agree(comm, resume_folder, options, kwargs)
    manifest = agree(comm, checkpoint.store.manifests.read, folder) if folder else None
    seed = manifest.seed if manifest else _shuffle_seed(comm)

    def prepare():
        data, validation_data = split_validation((x, y, kwargs.get("sample_weight")), kwargs)
        model_checks.check_inputs(model, data[0], options["check_numerics"], *data[1:])
        digest = data_digest(*data) if options["check_data"] else None
        sources = fit_sources(
            data,
            validation_data,
            kwargs,
            batch_size=batch_size,
            seed=seed,
            strategy=None if options["planning"] else resolved,
        )
        return *sources, digest

    source, validation_source, digest = agree(comm, prepare)
    if options["check_data"]:
        _check_same_data(comm, digest)
    if options["planning"] is not None:
        resolved = _planned(comm, model, source, options, kwargs)
    agree(comm, model_checks.check_tensor_parallel, model, resolved, options["comm"])
    agree(comm, model_checks.check_expert_parallel, model, resolved, options["comm"])
    agree(comm, model_checks.check_sharded_optimizer, model, resolved, options["comm"])
    trainer = _make_trainer(
        model,
        resolved,
        comm,
        comm_backend=options["comm"],
        restoring=folder is not None,
        inputs=input_arrays(source),
    )
    _say_layout(model, resolved, kwargs)
    _say_whole_gradients(trainer, resolved, kwargs)
    for notice in model_checks.training_notices(model, resolved) if comm.Get_rank() == 0 else ():
        warnings.warn(notice, stacklevel=3)
    trainer.use_watchdog(timeout)
    trainer.check_numerics = options["check_numerics"]
    trainer.seed = seed
    resumed = resume(comm, trainer, folder, kwargs)
    sources = (source, validation_source)
    return _run(comm, model=model, work=lambda: _epochs(trainer, sources, epochs, resumed, kwargs))


def _epochs(trainer, sources, epochs: int, resumed, kwargs):
    """The engine's epochs over the (training, validation) `sources`, from where `resumed`
    (resume's first epoch, first batch and callback states) starts, with hf.fit's `kwargs`."""
    source, validation_source = sources
    initial_epoch, start_batch, callback_states = resumed
    with contextlib.ExitStack() as signals:  # preemption (hf.callbacks.Checkpoint)
        for saver in checkpoint_callbacks(kwargs):
            signals.enter_context(saver.catching_signals())
        return fit_loop(
            trainer,
            source,
            epochs=epochs,
            initial_epoch=initial_epoch,
            start_batch=start_batch,
            callback_states=callback_states,
            steps_per_epoch=kwargs.get("steps_per_epoch"),
            callbacks=kwargs.get("callbacks"),
            verbose=kwargs.get("verbose", "auto"),
            validation_source=validation_source,
            validation_steps=kwargs.get("validation_steps"),
            validation_freq=kwargs.get("validation_freq", 1),
        )


def evaluate(
    model,
    x=None,
    y=None,
    *,
    batch_size=None,
    sample_weight=None,
    steps=None,
    callbacks=None,
    return_dict=False,
    verbose="auto",
    strategy="auto",
    num_partitions=None,
    num_replicas=None,
    num_microbatches=None,
):
    """Loss and metrics of `model` on the data, like `model.evaluate`, on every strategy.

    For example:
        loss, accuracy = hf.evaluate(model, x_test, y_test, batch_size=128, strategy="model")
    """
    resolved = _resolve(model, strategy, num_partitions, num_replicas, num_microbatches)
    if size() == 1:
        keras_options = dict(sample_weight=sample_weight, steps=steps, callbacks=callbacks)
        keras_options.update(return_dict=return_dict, verbose=verbose)
        return _in_keras(model.evaluate, resolved, x, batch_size, y, **keras_options)
    comm = loops_comm()
    devices.prepare(comm, resolved.bind_gpus)
    source = agree(comm, make_source, x, y, sample_weight, batch_size=batch_size)
    trainer = _make_trainer(model, resolved, comm, inputs=input_arrays(source))
    logs = _run(comm, lambda: evaluate_loop(trainer, source, steps=steps), model)
    if return_dict:
        return logs
    return _keras.metrics_in_order(model, logs)


def _in_keras(method, resolved, x, batch_size, *args, **options):
    """Keras's own bound `method` (evaluate, predict) in one process: the model materialised,
    an `hf.data` reader handed over as Keras data, mixtures dispatched as `hf.fit` would."""
    model = method.__self__
    deferred.materialize_model(model)
    if hasattr(x, "as_keras"):
        x, batch_size = x.as_keras(batch_size=batch_size or 32), None
    with sparse_in_keras(model, resolved.sparse_experts):
        return method(x, *args, batch_size=batch_size, **options)


def predict(
    model,
    x,
    *,
    batch_size=None,
    steps=None,
    verbose="auto",
    strategy="auto",
    num_partitions=None,
    num_replicas=None,
    num_microbatches=None,
):
    """The model's outputs for `x`, like `model.predict`, identical on every rank.

    For example:
        probabilities = hf.predict(model, x_test, batch_size=256, strategy="model")
    """
    resolved = _resolve(
        model, strategy, num_partitions, num_replicas, num_microbatches, compiled=False
    )
    if size() == 1:
        return _in_keras(model.predict, resolved, x, batch_size, steps=steps, verbose=verbose)
    comm = loops_comm()
    devices.prepare(comm, resolved.bind_gpus)
    source = agree(comm, make_source, x, batch_size=batch_size)
    trainer = _make_trainer(model, resolved, comm, needs_loss=False, inputs=input_arrays(source))
    return _run(comm, lambda: predict_loop(trainer, source, steps=steps), model)

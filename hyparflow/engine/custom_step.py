"""A model's own `train_step`, `test_step` or `compute_loss`, run by each data-parallel replica.

hf.fit's engine runs its own step, which would skip a model's overrides (a GAN's two updates,
the Keras guide's "Customizing what happens in fit()"). Under pure data parallelism the whole
model lives on every rank, so each replica can run the model's own step on its share of the
global batch, as Horovod does: while the step is traced, every optimizer of the model has its
`apply` wrapped so that the gradients are summed over the replicas, each weighted by its share
of the global batch, before the update (under ZeRO-1/2/3 each optimizer's apply steps this
replica's slices of the variables it is applied to instead: sharded_optimizer/
step_optimizers.py). Metric states are summed over the
replicas for the logs (`ReplicaMetrics`). docs/engine.md, "Custom training steps", says when
this equals Keras.
"""

from __future__ import annotations

import contextlib
import functools

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow.comm.agree import AgreedError
from hyparflow.comm.in_graph import allreduce
from hyparflow.data.batches import split_bounds, split_sizes
from hyparflow.engine.keras_semantics.random_slices import slice_of
from hyparflow.engine.sharded_optimizer.checkpoint import SliceCheckpoint
from hyparflow.engine.sharded_optimizer.refusal import refusal
from hyparflow.engine.sharded_optimizer.step_optimizers import StepOptimizers
from hyparflow.engine.trainer import Trainer
from hyparflow.intercept import Replaced
from hyparflow.own_steps import own_steps
from hyparflow.traced import traced

TAG = "custom_step"  # the tag of its traffic record in the trainer's `TrafficLog`


def needs_equal_shares(model) -> bool:
    """Whether every batch must split evenly over the replicas: a step of the model's own may
    update its metrics once per call (the guide's `loss_tracker.update_state(loss)`), which
    sums over replicas as Keras's one update only when every replica has as many samples.
    Keras's own step with an overridden `compute_loss` weights each update by its samples."""
    return any(name in own_steps(model) for name in ("train_step", "test_step"))


def make_trainer(model, strategy, comm, plan=None, **kwargs) -> Trainer:
    """The `Trainer` for `model`: a `CustomStepTrainer` when it overrides a step or the loss
    and the layout keeps it whole (model_checks.check_standard_steps refuses training it
    otherwise; prediction runs no step of the model's own)."""
    whole = plan is None and strategy.tensor == 1
    kind = CustomStepTrainer if whole and own_steps(model) else Trainer
    return kind(model, strategy, comm, plan, **kwargs)


def optimizers_of(model) -> list:
    """The optimizers a step of the model may apply: the compiled one and any the model holds
    as an attribute (a GAN's generator and discriminator optimizers)."""
    found: list = []
    for value in [getattr(model, "optimizer", None), *vars(model).values()]:
        if isinstance(value, keras.optimizers.Optimizer) and not any(value is f for f in found):
            found.append(value)
    return found


def _averaged_apply(apply, comm, traffic, weight, grads, trainable_variables=None, **kwargs):
    """`optimizer.apply` on the gradients summed over `comm`, this replica's weighted by
    `weight` (a tensor: its share of the global batch): one flat allreduce in the graph,
    counted in `traffic`."""
    grads = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    if present:
        dense = [tf.convert_to_tensor(grads[i]) for i in present]  # row slices become dense
        wire = tf.float64 if any(g.dtype == tf.float64 for g in dense) else tf.float32
        flat = tf.concat([tf.reshape(tf.cast(g, wire), [-1]) for g in dense], 0)
        total = allreduce(comm, flat * tf.cast(weight, wire), traffic)
        sizes = [int(np.prod(g.shape)) for g in dense]
        for i, g, part in zip(present, dense, tf.split(total, sizes), strict=True):
            grads[i] = tf.cast(tf.reshape(part, tf.shape(g)), g.dtype)
    return apply(grads, trainable_variables, **kwargs)


@contextlib.contextmanager
def averaged_gradients(optimizers, comm, traffic, weight, sliced=None):
    """While active (around a call that may trace the step), each of `optimizers` applies the
    replicas' weighted sum of the gradients it is given (its allreduces counted in `traffic`);
    `sliced` (ZeRO-1/2/3, a `StepOptimizers`), if given, replaces every optimizer's apply by
    one that steps this replica's slices of the variables it is applied to. Afterwards they
    are as they were."""

    def replacing(optimizer):
        if sliced is not None:
            return lambda apply: sliced.replacing(optimizer, apply, weight)
        return lambda apply: functools.partial(_averaged_apply, apply, comm, traffic, weight)

    with Replaced((opt, "apply", replacing(opt)) for opt in optimizers):  # these instances only
        yield


def _as_tensors(structure):
    return tree.map_structure(lambda a: None if a is None else tf.convert_to_tensor(a), structure)


def _refuse_row_slices(model, row_kinds) -> None:
    """The model's own step hands its optimizer the replicas' sum as one dense tensor, which
    would change how Keras applies row-sparse gradients (engine/gradients/sparse.py): refused."""
    rows = [v.path for v in model.trainable_variables if row_kinds.has_rows(v)]
    if rows:
        raise ValueError(
            f"{type(model).__name__} overrides train_step, and variables {rows[:3]} receive "
            "row-sparse gradients (tf.IndexedSlices), which its optimizer applies with sparse "
            "semantics; hyparflow sums a custom step's gradients over replicas densely, which "
            "would change that update. Train with the standard step (move the logic into "
            "layers, losses or metrics) or on one replica."
        )


class CustomStepTrainer(Trainer):
    """`Trainer` whose training and evaluation steps are the model's own (Keras's `train_step`
    and `test_step`, overridden or calling an overridden `compute_loss`), one per replica on
    its share of the global batch, gradients summed over the replicas where each optimizer
    applies them. Prediction, weights, checkpoints' state and the logs' metric sums are the
    data-parallel `Trainer`'s."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        if self.topology.num_replicas > 1:
            _refuse_row_slices(model, self.parts.setting.row_kinds)
        self._equal_shares = needs_equal_shares(model)
        self._sliced = self._sliced_apply()
        self._returned = None  # what the last step returned (Keras's logs of that batch)
        self._matches: dict = {}
        self._train_fn = traced(self._train_body, reduce_retracing=True)
        self._test_fn = traced(model.test_step, reduce_retracing=True)

    def _sliced_apply(self) -> StepOptimizers | None:
        """ZeRO-1/2/3: every optimizer the step applies steps this replica's slices of the
        variables it is applied to, its state built for them alone (None without sharding)."""
        sharded = self.parts.sharded_update
        if sharded is None:
            return None
        comm, traffic = self.topology.stage_comm, self.traffic.of(TAG)
        backend = self.parts.setting.comm_backend
        return StepOptimizers(
            sharded,
            comm,
            traffic,
            self.guard,
            lambda optimizer: refusal(optimizer, self.strategy, backend),
            slices_only=self.shards_weights,
            on_compiled=self._compiled_on_part,
        )

    def _compiled_on_part(self, slices) -> None:
        """The step applies the compiled optimizer to part of the model: checkpoints and the
        fit's end read its state from its own slices (`slices`)."""
        weights = self.parts.sharded_weights
        self.stage_state.optimizer_shard = SliceCheckpoint(slices, weights, slices.variables)

    def sliced_optimizers(self) -> list:
        """(optimizer, `SliceCheckpoint`) of each optimizer the model's own step applies but
        the compiled one, each holding this replica's slices of its state (the fit's end
        gathers them whole: loops/optimizer_gather.py)."""
        if self._sliced is None:
            return []
        return [
            (slices.optimizer, SliceCheckpoint(slices, built_for=slices.variables))
            for slices in self._sliced.others()
        ]

    def _train_body(self, data, weight, rows):
        optimizers = optimizers_of(self.model)
        sums = averaged_gradients(
            optimizers, self.topology.stage_comm, self.traffic.of(TAG), weight, self._sliced
        )
        # dropout: this share's rows of the global batch's masks, as the engine's own step
        with sums, slice_of(rows), self._filled():
            return self.model.train_step(data)

    @contextlib.contextmanager
    def _filled(self):
        """Inside a trace, under ZeRO-3: the variables hold the gathered weights for the
        step, and nothing after it (nothing otherwise)."""
        if not self.shards_weights:
            yield
            return
        self._sliced.fill()
        yield
        self._sliced.empty()

    def _share(self, batch):
        """This replica's (data, share of the global batch, [offset, global size]), or an
        agreed error if the batch cannot be split as the model's step needs."""
        replicas = self.topology.num_replicas
        sizes = split_sizes(batch.size, replicas)
        if min(sizes) == 0 or (self._equal_shares and len(set(sizes)) > 1):
            raise AgreedError(
                ValueError(
                    f"A batch of {batch.size} samples does not split evenly over {replicas} "
                    f"replicas, which {type(self.model).__name__}'s own train_step/test_step "
                    "needs to equal Keras on the global batch (its metric updates are per "
                    "call). Choose batch_size and the number of samples so that every batch, "
                    f"the last one included, is a multiple of {replicas} (or drop the rest)."
                )
            )
        start, stop = split_bounds(batch.size, replicas, self.topology.replica)
        x, y, sample_weight = (_as_tensors(part) for part in batch.part(start, stop))
        data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        return data, (stop - start) / batch.size, tf.constant([start, batch.size], tf.int32)

    def optimizer_step(self, batch) -> None:
        """The model's own `train_step` on this replica's share of `batch`."""
        if self.check_numerics:
            raise AgreedError(
                ValueError(
                    f"check_numerics=True checks the engine's own step; "
                    f"{type(self.model).__name__} runs its own, so check inside it "
                    "(tf.debugging.check_numerics) and pass check_numerics=False."
                )
            )
        data, share, rows = self._share(batch)
        with self.guard("custom train step (gradients summed over replicas)"):
            weight = tf.constant(share, tf.float32)
            self._returned = _any_batch_size(self._train_fn, data, weight, rows)
        self._end_step()

    def eval_step(self, batch, reg_value: float) -> None:
        """The model's `test_step` on this replica's share (it adds its own regularization)."""
        del reg_value
        data, _, _ = self._share(batch)
        self._returned = _any_batch_size(self._test_fn, data)  # weights held: after sync_weights

    def logs(self) -> dict:
        """As Keras's fit: the metrics' results (states summed over the replicas) when the step
        returned a dict keyed like them, else the step's own values averaged over the replicas
        (equal shares then: `needs_equal_shares`; exact for means over the samples)."""
        returned = self._returned
        if not isinstance(returned, dict) or self._keyed_like_metrics(returned):
            return super().logs()
        flat = {k: np.asarray(v, np.float64) for k, v in _flatten(returned).items()}
        sizes = [v.size for v in flat.values()]
        share = 1.0 / self.topology.num_replicas  # shares are equal whenever they must be
        values = np.concatenate([v.ravel() for v in flat.values()] + [np.zeros(0)]) * share
        total = np.empty_like(values)
        with self.guard("average the step's logs over replicas"):
            self.topology.stage_comm.Allreduce(values, total)
        parts = np.split(total, np.cumsum(sizes)[:-1]) if sizes else []
        return {
            k: float(p[0]) if v.ndim == 0 else p.reshape(v.shape)
            for (k, v), p in zip(flat.items(), parts, strict=True)
        }

    def _keyed_like_metrics(self, returned: dict) -> bool:
        key = tuple(sorted(returned))
        if key not in self._matches:  # Keras's _get_metrics_result_or_logs, on the raw logs
            self._matches[key] = set(key) == set(self.model.get_metrics_result())
        return self._matches[key]


def _any_batch_size(function, data, *args):
    """`function(data, *args)`, traced once for batches of any size: the last batch is often
    smaller, and each trace of a Keras step costs seconds."""
    leaves = [t for t in tf.nest.flatten(data) if t is not None]
    if function.experimental_get_tracing_count() == 0 and all(
        isinstance(t, tf.Tensor) and t.shape.rank for t in leaves
    ):
        specs = tf.nest.map_structure(
            lambda t: None if t is None else tf.TensorSpec([None, *t.shape[1:]], t.dtype), data
        )
        function.get_concrete_function(specs, *args)
    return function(data, *args)


def _flatten(logs: dict) -> dict:
    """Nested result dicts (a CompileMetrics' result) flattened, as Keras's callbacks see them."""
    flat = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            flat.update(_flatten(value))
        else:
            flat[key] = value
    return flat

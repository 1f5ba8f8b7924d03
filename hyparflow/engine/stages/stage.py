"""One stage's forward and backward over micro-batches, compiled once with tf.function.

The forward runs as a `tf.function` under an eager `tf.GradientTape`; TensorFlow then records
the call as one op and differentiates it with the function's compiled backward graph, keeping
only that micro-batch's activations alive until its backward (GPipe's activation stash).
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.engine.keras_semantics.random_slices import slice_of
from hyparflow.engine.stages.runner import RunnerBase
from hyparflow.traced import traced


def _is_float(tensor) -> bool:
    return tensor.dtype.is_floating


def _or_zeros(grad, like):
    """`grad`, or zeros shaped like `like` where nothing connects it to the loss."""
    return tf.zeros_like(like) if grad is None else grad


def _constant(tensor):
    """`tensor` cut off from differentiation (None stays None)."""
    return None if tensor is None else tf.stop_gradient(tensor)


class StageRunner(RunnerBase):
    """Forward, backward and gradient accumulation of one pipeline stage.

    `call(inputs, training)` computes the stage's outputs; `variables` are the trainable
    variables it differentiates; `loss(y, y_pred, sample_weight)` (last stage only) turns its
    outputs into the compiled loss, a mean over the micro-batch.

    `metrics(y, y_pred, sample_weight)`, if given at the last stage, updates the compiled
    metrics inside the loss forward's call (`updates_metrics` then tells the trainer not to),
    saving a compiled call per micro-batch; not with `recompute`, whose backward replays the
    forward.

    `input_grads=False` (the first stage: nothing upstream) skips the gradients of the
    inputs, which would otherwise cost the first layer's input-gradient product per
    micro-batch; `backward` then returns None for every input.

    With a `layout` (`FlatLayout` of `variables`), `take_flat_gradients` hands the step's
    gradients over as the layout's one flat tensor (one `reduce_flat` across replicas).
    With `flat_backward` as well, the stage reads its variables from views of one flat tensor
    of their values, packed once per step, and differentiates that tensor instead: each
    backward then yields the stage's whole gradient as one flat tensor, built inside the
    compiled backward (the split's gradient is a concat), so accumulating a micro-batch is
    one add where a list costs Python work per variable; but the concat copies every
    gradient byte once per micro-batch. Without it the gradients are summed per variable and
    concatenated once, when taken. `FlatLayout.flat_backward_pays` says which is cheaper
    (docs/engine.md, "Flat pipeline gradients").

    `sparse`, `added_losses`, `train_scope` and `input_shapes` are `RunnerBase`'s options
    (`layout`, if any, covers the variables that are not embedding tables). The layers' added
    loss joins the micro-batch's loss, weighted by `scale` like the compiled loss.

    `recompute=True` keeps only each micro-batch's inputs between forward and backward and
    recomputes its activations in the backward (Chen et al. 2016, "Training Deep Nets with
    Sublinear Memory Cost"; GPipe's re-materialization).

    With `gather` (ZeRO-3, a `RunnerBase` option; needs `recompute`), each forward, each
    backward's recomputation and each inference gathers the dense variables' values afresh
    and differentiates them: the values live only during that call.

    `reuse_forward=True` (with `recompute`) runs each forward under a tape as well and keeps
    it until this runner's next forward or backward (or `drop_kept_forwards`): where that is
    the same micro-batch's backward, it differentiates the tape instead of recomputing, and
    (with `gather`) gathers nothing. It saves a forward and a gather where the backward
    follows its forward at once (the last segment of a stage, the last stage under 1F1B) and
    holds nothing a recomputation would not: the kept activations and gathered values are
    what the backward needs next.

    `tally` (a `moe.RouterTally`, GPipe only): the mixture blocks' router losses of a step of
    several micro-batches. Each forward returns the blocks' routing counts and probability
    sums beside its outputs; each backward differentiates the sums with the gradient the
    tally derives from every micro-batch's counts (moe/router_tally.py).

    For example, a first stage (no loss; its inputs need no gradients):
        runner = StageRunner(lambda x, training: stage_model(x, training=training),
                             stage_model.trainable_variables, input_grads=False)
        outputs = runner.forward(0, x)
        runner.backward(0, output_grads)  # the outputs' gradients, from the next stage
        grads = runner.take_gradients()
    """

    def __init__(
        self,
        call,
        variables,
        loss=None,
        recompute=False,
        state_variables=(),
        metrics=None,
        input_grads=True,
        layout=None,
        flat_backward=True,
        tally=None,
        reuse_forward=False,
        **common,
    ):
        super().__init__(call, variables, **common)  # RunnerBase's options
        if self._gather is not None and (not recompute or layout is not None):
            raise ValueError("a runner gathering its weights recomputes and keeps lists")
        if self.slice_gradients and (recompute or layout is not None):
            raise ValueError("a runner whose layers gather recomputes nothing and keeps lists")
        if reuse_forward and not recompute:
            raise ValueError("reuse_forward saves a recomputation: it needs recompute=True")
        self.reuse_forward = reuse_forward
        self._kept_forwards = {}  # micro-batch -> (tape, what to differentiate), reuse_forward
        self.reused_forwards = 0  # backwards that differentiated their forward's kept tape
        self._tally = tally
        self._last_routed = ()  # the last forward's routing counts and sums (with a tally)
        self.layout = layout
        self.flat_backward = layout is not None and flat_backward
        self.input_grads = input_grads
        self.recompute = recompute
        self._metrics = metrics if loss is not None and not recompute else None
        # False: the trainer updates metrics from the outputs.
        self.updates_metrics = self._metrics is not None
        # What a forward changes besides activations (BatchNormalization statistics, Dropout
        # seeds): put back around a recomputation so that it replays the first forward exactly.
        self.state_variables = list(state_variables)
        self.is_last = loss is not None
        self._loss = loss
        self._pending = {}
        self._params = None  # this step's flat variable values (with flat_backward)
        self._pack_fn = traced(self._pack_body)
        self._flatten_fn = traced(self._flatten_body)
        # Traced once, before the first call, with the batch size and varying lengths unknown
        # (engine/relaxed.py): every micro-batch size then runs the one trace.
        self._forward_fn = traced(self._forward_body, reduce_retracing=True)
        self._loss_forward_fn = traced(self._loss_forward_body, reduce_retracing=True)

    def _differentiable(self, inputs):
        # A taped function's backward graph computes the gradient of every float input unless
        # the input is cut off from it here.
        return inputs if self.input_grads else tree.map_structure(_constant, inputs)

    def _pack_body(self):
        dense = [tf.convert_to_tensor(self._sources[i]) for i in self.dense]
        return self.layout.flatten(dense, 0.0)

    def _flatten_body(self, grads):
        return self.layout.flatten(grads, 0.0)

    def _training_call(self, inputs, rows, params):
        """The stage's training forward and its layers' added loss (zero if none); with
        `params`, its variables read views of it. `rows` ([offset, global batch size]) places
        the micro-batch in the global batch, whose dropout masks it takes its rows of."""
        if self._tally is not None:  # drop what a trace that raised recorded (relaxed.Traces)
            self._tally.collect()
        inputs = self._differentiable(inputs)
        if params is None:
            with slice_of(rows), self._train_scope():
                outputs = self._call(inputs, True)
            return outputs, self._added()
        # gathered values or slices, or views of the flat tensor; tables are read as they are
        gathers = self._gather is not None or self.slice_gradients
        views = params if gathers else self.layout.unflatten(params)
        replay = functools.partial(self._replayed, rows)  # a boundary's recomputation
        with self.reading(views, replay), slice_of(rows), self._train_scope():
            outputs = self._call(inputs, True)
            added = self._added()  # the scope collects what layers add
        return outputs, added

    @contextlib.contextmanager
    def _replayed(self, rows):
        """The contexts of a training call, entered again (a layer boundary's recomputation)."""
        with slice_of(rows), self._train_scope():
            yield

    def _routed(self, scale) -> tuple:
        """Inside a training forward's trace: the tally's (counts, sums, sums times `scale`) of
        the blocks it ran, or () (no tally, or no block recorded)."""
        collected = None if self._tally is None else self._tally.collect()
        if collected is None:
            return ()
        self.has_added_losses = True  # the step's loss values then sum the tally's parts
        counts, sums = collected
        return counts, _constant(sums), sums * _constant(scale)

    def _forward_body(self, inputs, scale, rows, params):
        outputs, added = self._training_call(inputs, rows, params)
        return outputs, added, added * _constant(scale), self._routed(scale)

    def _loss_forward_body(self, inputs, y, sample_weight, scale, rows, params):
        y_pred, added = self._training_call(inputs, rows, params)
        # Targets, weights and scale are data: no gradient flows to them.
        y, sample_weight, scale = tree.map_structure(_constant, (y, sample_weight, scale))
        loss = self._loss(y, y_pred, sample_weight)
        if self._metrics is not None:
            self._metrics(y, y_pred, sample_weight)
        return y_pred, loss, added, (loss + added) * scale, self._routed(scale)

    def forward(self, microbatch: int, inputs, targets=None, scale=1.0, rows=None):
        """Run the forward of `microbatch`, keeping what its backward needs.

        Returns the outputs; at the last stage `(y_pred, loss)` where `loss` is the micro-batch
        mean and `scale` (its share of the global batch) weights its gradient. `rows`
        (offset, global batch size) says which rows of the global batch these are, so that
        dropout applies Keras's full-batch mask. With `recompute`, only the inputs and the
        stage's random/statistics state are kept, and the backward runs the forward again.
        """
        scale = tf.constant(scale, tf.float32)
        rows = None if rows is None else tf.constant(rows, tf.int32)
        self.drop_kept_forwards()
        if self.recompute:
            snapshot = [np.array(v.numpy()) for v in self.state_variables]
            if self.reuse_forward:
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    result, differentiate = self._taped_forward(inputs, targets, scale, rows, tape)
                self._kept_forwards[microbatch] = (tape, differentiate)
            else:
                result, _ = self._taped_forward(inputs, targets, scale, rows, tape=None)
            self._pending[microbatch] = (None, (inputs, targets, scale, rows, snapshot))
            if self._last_routed:
                self._tally.forwarded(microbatch, *self._last_routed)
            return result
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            result, differentiate = self._taped_forward(inputs, targets, scale, rows, tape)
        self._pending[microbatch] = (tape, differentiate)
        if self._last_routed:
            self._tally.forwarded(microbatch, *self._last_routed)
        return result

    def _taped_forward(self, inputs, targets, scale, rows, tape):
        """The forward; under `tape`, also what to differentiate: (inputs, watched inputs,
        sources, targets)."""
        watched = [t for t in tree.flatten(inputs) if _is_float(t)] if self.input_grads else []
        params = self._parameters()
        if params is None:
            sources = self._sources
        elif self.slice_gradients:  # the slices, then the tables
            sources = [*params, *[self._sources[i] for i in self.sparse]]
        elif self._gather is not None:  # per variable, the gathered values in the dense places
            sources = list(self._sources)
            for i, value in zip(self.dense, params, strict=True):
                sources[i] = value
        else:
            sources = [params] + [self._sources[i] for i in self.sparse]
        if tape is not None:
            tape.watch(watched)
            tape.watch(sources)
        if self.is_last:
            y, sample_weight = targets
            args = (inputs, y, sample_weight, scale, rows, params)
            function = self._relaxed(self._loss_forward_fn, args, targets=(1, 2))
            y_pred, loss, self.last_added, scaled, routed = function(*args)
            return (y_pred, loss), (inputs, watched, sources, [scaled, *self._kept(routed)])
        args = (inputs, scale, rows, params)
        result, self.last_added, added, routed = self._relaxed(self._forward_fn, args)(*args)
        floats = [t for t in tree.flatten(result) if _is_float(t)]
        if self.has_added_losses:  # differentiated with the outputs (its gradient: 1)
            floats.append(added)
        return result, (inputs, watched, sources, floats + self._kept(routed))

    def gathers_in_backward(self, microbatch: int) -> bool:
        """Whether the backward of `microbatch` gathers: it recomputes its forward (no kept
        tape)."""
        return self.gathers and self.recompute and microbatch not in self._kept_forwards

    def prefetch_backward(self, microbatch: int) -> None:
        """`prefetch` for the backward of `microbatch`, where it will gather."""
        if self.gathers_in_backward(microbatch):
            self.prefetch()

    def drop_kept_forwards(self) -> None:
        """Let the kept forwards' tapes go (`reuse_forward`): another forward or backward is
        about to run, so their backwards will recompute instead of holding them meanwhile."""
        self._kept_forwards.clear()

    def _kept(self, routed: tuple) -> list:
        """The routed sums to differentiate (their gradient from the tally); the counts and
        sums, for `forward` to hand the tally."""
        self._last_routed = routed[:2]
        return list(routed[2:])

    def _recomputed(self, inputs, targets, scale, rows, snapshot):
        """Run the forward again under a tape, from the state it first saw (same Dropout masks,
        no second BatchNormalization update)."""
        current = [np.array(v.numpy()) for v in self.state_variables]
        for variable, value in zip(self.state_variables, snapshot, strict=True):
            variable.assign(value)
        try:
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                _, differentiate = self._taped_forward(inputs, targets, scale, rows, tape)
        finally:
            for variable, value in zip(self.state_variables, current, strict=True):
                variable.assign(value)
        return tape, differentiate

    def backward(self, microbatch: int, output_grads=None):
        """Backward of `microbatch`: accumulate variable gradients, return input gradients.

        `output_grads` are the gradients of the float outputs, in `forward`'s flattened order
        (None at the last stage). Input gradients come back in the order of the flattened
        inputs, None for integer inputs. The micro-batch's activations are released here.
        """
        tape, kept = self._pending.pop(microbatch)
        reused = self._kept_forwards.pop(microbatch, None)
        self.drop_kept_forwards()  # another micro-batch's: not held through this backward
        if reused is not None:
            tape, kept = reused
            self.reused_forwards += 1
        elif tape is None:
            tape, kept = self._recomputed(*kept)
        inputs, watched, sources, targets = kept
        output_grads = self._with_routed_gradient(microbatch, output_grads)
        grads = self._differentiate(tape, targets, watched + sources, output_grads)
        self._accumulate(grads[len(watched) :], sources)
        return self._input_gradients(inputs, watched, grads[: len(watched)])

    def _with_routed_gradient(self, microbatch: int, output_grads):
        """`output_grads` and, where `microbatch` routed tokens through the tally's blocks, the
        gradient of their sums (at the last stage, after the loss's own gradient, 1)."""
        if self._tally is None or microbatch not in self._tally.routed:
            return output_grads
        routed = self._tally.output_gradient(microbatch)
        if self.is_last:
            return [tf.ones((), tf.float32), routed]
        return [
            *output_grads,
            *([tf.ones((), tf.float32)] if self.has_added_losses else []),
            routed,
        ]

    def _differentiate(self, tape, targets, wrt: list, output_grads) -> list:
        """The gradients of `targets` with respect to `wrt`, given the gradients of the stage's
        float outputs (`output_grads`, in `forward`'s flattened order, then the added loss's
        and the routed sums' where `_with_routed_gradient` put them; None at the last stage
        without routed sums)."""
        if not self.is_last and len(output_grads) < len(targets):
            output_grads = list(output_grads)
            if self.has_added_losses:
                output_grads.append(tf.ones((), tf.float32))
        return tape.gradient(
            targets,
            wrt,
            output_gradients=output_grads,
            # None, not zeros: a table this stage does not read contributes no rows
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )

    def _accumulate(self, var_grads: list, sources: list) -> None:
        """Add one micro-batch's variable gradients (None where unconnected) to the step's."""
        tables = [self.variables[i] for i in self.sparse]
        if self.slice_gradients:
            count = len(sources) - len(tables)
            slices = [
                _or_zeros(g, s) for g, s in zip(var_grads[:count], sources[:count], strict=True)
            ]
            sparse = [
                row_sparse.or_empty(g, v) for g, v in zip(var_grads[count:], tables, strict=True)
            ]
            self._grads = (
                slices
                if self._grads is None
                else [a + g for a, g in zip(self._grads, slices, strict=True)]
            )
        elif self.flat_backward:
            flat = _or_zeros(var_grads[0], sources[0])
            sparse = [row_sparse.or_empty(g, v) for g, v in zip(var_grads[1:], tables, strict=True)]
            self._grads = flat if self._grads is None else self._grads + flat
        else:
            row_sparse.check_kinds(var_grads, self.sparse, self.variables)
            sparse = [
                row_sparse.or_empty(var_grads[i], v)
                for i, v in zip(self.sparse, tables, strict=True)
            ]
            dense = [tf.convert_to_tensor(_or_zeros(var_grads[i], sources[i])) for i in self.dense]
            if self._grads is None:
                self._grads = dense
            else:
                self._grads = [a + g for a, g in zip(self._grads, dense, strict=True)]
        self._sparse_per_microbatch.append(sparse)

    def _input_gradients(self, inputs, watched: list, grads: list) -> list:
        """The gradients of the flattened inputs: zeros where unconnected, None for integer
        inputs (and for every input of a stage without `input_grads`)."""
        if not self.input_grads:
            return [None] * len(tree.flatten(inputs))
        by_input = iter(_or_zeros(g, t) for g, t in zip(grads, watched, strict=True))
        return [next(by_input) if _is_float(t) else None for t in tree.flatten(inputs)]

    def _parameters(self):
        """This step's flat variable values (None unless `flat_backward`), packed at its
        first forward (or `prepare`): variables change only between steps (optimizer,
        callbacks, restores). With `gather`, the dense variables' values, gathered afresh."""
        if self._gather is not None:
            return self.gathered()
        if self.slice_gradients:
            return self.slices()
        if not self.flat_backward:
            return None
        if self._params is None:
            self._params = self._pack_fn()
        return self._params

    def prepare(self) -> None:
        """Pack this step's flat variable values now (a no-op unless `flat_backward`), e.g. while
        the stage waits for its first activations, instead of at its first forward."""
        if self._gather is None:  # gathered values live only during a call
            self._parameters()

    @property
    def _totals_are_flat(self) -> bool:
        return self.flat_backward

    def take_dense_gradients(self) -> list:
        if self.slice_gradients:
            raise ValueError("this runner's gradients are slices: take_slice_gradients")
        return super().take_dense_gradients()

    def take_slice_gradients(self) -> list:
        """This replica's slice of each group's gradient (`slice_gradients`), summed over the
        micro-batches since the last call and over the replicas (zeros if none)."""
        grads, self._grads = self._grads, None
        if grads is None:
            return [tf.zeros_like(s) for s in self.slices()]
        return grads

    def take_flat_gradients(self):
        """The dense variables' summed gradients as the layout's one flat tensor (needs a
        `layout`; take the tables' with `take_sparse_gradients`); the next forward packs the
        variables anew."""
        if not self.flat_backward:
            grads, self._grads = self._grads, None
            if grads is None:
                return self.layout.zeros()
            return self._flatten_fn(grads)  # one copy per step, not per micro-batch
        flat, self._grads, self._params = self._grads, None, None
        return self.layout.zeros() if flat is None else flat

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose backward has not run yet."""
        return len(self._pending)

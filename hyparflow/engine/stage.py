"""One stage's forward and backward over micro-batches, compiled once with tf.function.

The forward runs as a `tf.function` under an eager `tf.GradientTape`; TensorFlow then records
the call as one op and differentiates it with the function's compiled backward graph, keeping
only that micro-batch's activations alive until its backward (GPipe's activation stash).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from keras import tree


def _is_float(tensor) -> bool:
    return tensor.dtype.is_floating


def _constant(tensor):
    """`tensor` cut off from differentiation (None stays None)."""
    return None if tensor is None else tf.stop_gradient(tensor)


class StageRunner:
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

    `recompute=True` keeps only each micro-batch's inputs between forward and backward and
    recomputes its activations in the backward (Chen et al. 2016, "Training Deep Nets with
    Sublinear Memory Cost"; GPipe's re-materialization).

    Example:
        >>> runner = StageRunner(lambda x, training: model(x, training=training),
        ...                      model.trainable_variables, loss=model._compile_loss)
        >>> runner.forward(0, x, targets=(y, None), scale=1.0); runner.backward(0)
        >>> grads = runner.take_gradients()
    """

    layout = None  # gradients stay a list (FusedRunner may keep them flat)

    def __init__(
        self,
        call,
        variables,
        loss=None,
        recompute=False,
        state_variables=(),
        metrics=None,
        input_grads=True,
    ):
        self.variables = list(variables)
        self.input_grads = input_grads
        self.recompute = recompute
        self._metrics = metrics if loss is not None and not recompute else None
        # False: the trainer updates metrics from the outputs.
        self.updates_metrics = self._metrics is not None
        # What a forward changes besides activations (BatchNormalization statistics, Dropout
        # seeds): put back around a recomputation so that it replays the first forward exactly.
        self.state_variables = list(state_variables)
        # The tf.Variable behind each Keras variable: what a tape can watch and differentiate.
        self._sources = [getattr(v, "value", v) for v in self.variables]
        self.is_last = loss is not None
        self._call = call
        self._loss = loss
        self._pending = {}
        self._grads = None
        # Static shapes: one trace per distinct micro-batch size (usually two: full and last).
        self._forward_fn = tf.function(self._forward_body)
        self._loss_forward_fn = tf.function(self._loss_forward_body)
        self._infer_fn = tf.function(self._infer_body)

    def _differentiable(self, inputs):
        # A taped function's backward graph computes the gradient of every float input unless
        # the input is cut off from it here.
        return inputs if self.input_grads else tree.map_structure(_constant, inputs)

    def _forward_body(self, inputs):
        return self._call(self._differentiable(inputs), True)

    def _loss_forward_body(self, inputs, y, sample_weight, scale):
        y_pred = self._call(self._differentiable(inputs), True)
        # Targets, weights and scale are data: no gradient flows to them.
        y, sample_weight, scale = tree.map_structure(_constant, (y, sample_weight, scale))
        loss = self._loss(y, y_pred, sample_weight)
        if self._metrics is not None:
            self._metrics(y, y_pred, sample_weight)
        return y_pred, loss, loss * scale

    def _infer_body(self, inputs):
        return self._call(inputs, False)

    def forward(self, microbatch: int, inputs, targets=None, scale=1.0):
        """Run the forward of `microbatch`, keeping what its backward needs.

        Returns the outputs; at the last stage `(y_pred, loss)` where `loss` is the micro-batch
        mean and `scale` (its share of the global batch) weights its gradient. With
        `recompute`, only the inputs and the stage's random/statistics state are kept, and the
        backward runs the forward again.
        """
        scale = tf.constant(scale, tf.float32)
        if self.recompute:
            snapshot = [np.array(v.numpy()) for v in self.state_variables]
            result, _ = self._taped_forward(inputs, targets, scale, tape=None)
            self._pending[microbatch] = (None, (inputs, targets, scale, snapshot))
            return result
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            result, differentiate = self._taped_forward(inputs, targets, scale, tape)
        self._pending[microbatch] = (tape, differentiate)
        return result

    def _taped_forward(self, inputs, targets, scale, tape):
        """The forward; under `tape`, also what to differentiate: (watched inputs, targets)."""
        watched = [t for t in tree.flatten(inputs) if _is_float(t)] if self.input_grads else []
        if tape is not None:
            tape.watch(watched)
            tape.watch(self._sources)
        if self.is_last:
            y, sample_weight = targets
            y_pred, loss, scaled = self._loss_forward_fn(inputs, y, sample_weight, scale)
            return (y_pred, loss), (inputs, watched, scaled)
        result = self._forward_fn(inputs)
        return result, (inputs, watched, [t for t in tree.flatten(result) if _is_float(t)])

    def _recomputed(self, inputs, targets, scale, snapshot):
        """Run the forward again under a tape, from the state it first saw (same Dropout masks,
        no second BatchNormalization update)."""
        current = [np.array(v.numpy()) for v in self.state_variables]
        for variable, value in zip(self.state_variables, snapshot):
            variable.assign(value)
        try:
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                _, differentiate = self._taped_forward(inputs, targets, scale, tape)
        finally:
            for variable, value in zip(self.state_variables, current):
                variable.assign(value)
        return tape, differentiate

    def backward(self, microbatch: int, output_grads=None):
        """Backward of `microbatch`: accumulate variable gradients, return input gradients.

        `output_grads` are the gradients of the float outputs, in `forward`'s flattened order
        (None at the last stage). Input gradients come back in the order of the flattened
        inputs, None for integer inputs. The micro-batch's activations are released here.
        """
        tape, kept = self._pending.pop(microbatch)
        if tape is None:
            tape, kept = self._recomputed(*kept)
        inputs, watched, targets = kept
        grads = tape.gradient(
            targets,
            watched + self._sources,
            output_gradients=None if self.is_last else list(output_grads),
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        input_grads, var_grads = grads[: len(watched)], grads[len(watched) :]
        var_grads = [tf.convert_to_tensor(g) for g in var_grads]  # IndexedSlices -> dense
        if self._grads is None:
            self._grads = var_grads
        else:
            self._grads = [a + g for a, g in zip(self._grads, var_grads)]
        if not self.input_grads:
            return [None] * len(tree.flatten(inputs))
        by_input = iter(input_grads)
        return [next(by_input) if _is_float(t) else None for t in tree.flatten(inputs)]

    def infer(self, inputs):
        """Forward without gradients, in inference mode (validation, evaluate, predict)."""
        return self._infer_fn(inputs)

    def take_gradients(self) -> list:
        """Summed variable gradients of the micro-batches since the last call (zeros if none)."""
        grads = self._grads
        self._grads = None
        if grads is None:
            grads = [tf.zeros_like(v) for v in self.variables]
        return grads

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose backward has not run yet."""
        return len(self._pending)

"""A pipeline stage whose backward runs as two passes: input gradients (B), weight gradients (W).

The zero-bubble schedules (`schedule/zero_bubble.py`) run W after B, in the pipeline's
bubbles; `engine/stages/weight_taps.py` says how a TensorFlow backward is split. A stage that cannot
be split (`Taps.refusals`) runs 1F1B's merged backward at B and nothing at W, which the same
schedule keeps valid: W only ever waits for its own stage's B.
"""

from __future__ import annotations

import warnings

import tensorflow as tf
from keras import tree

from hyparflow.engine import relaxed
from hyparflow.engine.keras_semantics.random_slices import slice_of
from hyparflow.engine.stages import tap_shapes, weight_taps
from hyparflow.engine.stages.stage import StageRunner, _constant, _is_float, _or_zeros
from hyparflow.traced import traced

KEPT_TAP_SHAPES = 4  # zero taps kept for this many input shapes (each a micro-batch's outputs)


def _shapes_of(inputs) -> list[tuple]:
    """The shape of each flattened input."""
    return [tuple(t.shape) for t in tree.flatten(inputs)]


class SplitStageRunner(StageRunner):
    """`StageRunner` whose `backward` computes input gradients only and whose `weight` computes
    the micro-batch's weight gradients later.

    `layers`: the stage's layers (those owning `variables` are tapped). The options are
    `StageRunner`'s; the gradients are summed per variable (no flat backward: W yields them
    layer by layer). `split` is False once the first trace found the stage cannot be split
    (`refusals` says why); the runner is then a plain `StageRunner` whose `weight` does nothing.
    """

    def __init__(self, call, variables, *, layers, **options):
        options["flat_backward"] = False
        super().__init__(call, variables, **options)
        self._owners = weight_taps.weight_owners(layers, self.variables)
        self._synchronized = options.get("train_scope") is not None
        self.split = bool(self._owners)
        self.refusals: list[str] = []
        self._recorder = None  # the Taps of the last trace: its calls, what it saves
        self._calls = []  # the forward's layer calls (its trace's), which W replays
        self._shapes = []  # each tap's shape (engine/stages/tap_shapes.py)
        self._saved_specs = []  # specs of the calls' saved arguments
        self._saved: dict[int, list] = {}  # micro-batch -> its calls' saved arguments
        self._owed: dict[int, tuple] = {}  # micro-batch -> (saved arguments, taps' gradient)
        self._last_saved = None
        self._zeros: dict[tuple, list] = {}  # input shapes -> zero taps
        self._split_forward_fn = traced(self._split_forward_body, reduce_retracing=True)
        self._split_loss_forward_fn = traced(self._split_loss_forward_body, reduce_retracing=True)
        self._weight_fn = traced(self._weight_body, reduce_retracing=True)

    # --- the forward, tapped --------------------------------------------------------------
    def _tapped_call(self, inputs, rows, taps):
        inputs = self._differentiable(inputs)
        recorder = weight_taps.Taps(self._owners, taps)
        with slice_of(rows), self._train_scope(), recorder:
            outputs = self._call(inputs, True)
            added = self._added()  # the scope collects what layers add
        if taps is not None and recorder.tapped != len(taps):
            raise RuntimeError("hyparflow: the forward made fewer layer calls than discovered")
        for variable, value in recorder.updates.values():  # statistics, seeds: applied for real
            variable.assign(value)
        self._recorder = recorder
        return outputs, added, list(recorder.saved)

    def _split_forward_body(self, inputs, scale, rows, taps):
        outputs, added, saved = self._tapped_call(inputs, rows, taps)
        return outputs, added, added * _constant(scale), saved

    def _split_loss_forward_body(self, inputs, y, sample_weight, scale, rows, taps):
        y_pred, added, saved = self._tapped_call(inputs, rows, taps)
        y, sample_weight, scale = tree.map_structure(_constant, (y, sample_weight, scale))
        loss = self._loss(y, y_pred, sample_weight)
        if self._metrics is not None:
            self._metrics(y, y_pred, sample_weight)
        return y_pred, loss, added, (loss + added) * scale, saved

    def _traced_split(self, function, args: tuple, targets: tuple = ()) -> None:
        """Discover the stage's layer calls and each tap's shape (throwaway traces, relaxed
        and at `args`' shapes), then trace `function` once with the batch size and varying
        lengths unknown and a tap per tapped output; the stage turns unsplittable, with the
        reasons, where discovery found one."""
        if function.experimental_get_tracing_count() > 0 or not self.split:
            return
        if self.input_shapes is None:  # its function would trace per shape: taps per trace
            self._refuse(["the stage declares no input shapes"])
            return
        if self._synchronized:  # W would replay BatchNormalization on its replica's rows only
            self._refuse(["BatchNormalization statistics are summed across replicas"])
            return
        specs = relaxed.relaxed_specs((*args, None), self.input_shapes, targets)
        if not relaxed.traces(traced(function.python_function), specs):
            # its taps would be shaped per length; the whole backward traces per length
            self._refuse(["the stage cannot be traced with its lengths unknown"])
            return
        refusals = self._recorder.refusals
        relaxed_shapes = self._discovered_shapes()
        if not refusals:
            refusals = self._discover(function, (*args, None))
            exact = self._discovered_shapes()
            varying = _shapes_of(specs[0])
            shapes = tap_shapes.template(relaxed_shapes, exact, _shapes_of(args[0]), varying)
            refusals = [shapes] if isinstance(shapes, str) else refusals
        if refusals:
            self._refuse(refusals)
            return
        self._shapes = shapes
        function.get_concrete_function(*specs[:-1], self._tap_specs())
        self._calls = self._recorder.calls
        # the arguments W gets, as the relaxed trace shaped them
        self._saved_specs = [tf.TensorSpec(t.shape, t.dtype) for t in self._recorder.saved]

    def _refuse(self, refusals: list[str]) -> None:
        self.refusals, self.split = list(dict.fromkeys(refusals)), False
        warnings.warn(
            "hyparflow: this stage runs its backward whole (the zero-bubble schedule cannot "
            "split it): " + "; ".join(self.refusals[:3]),
            stacklevel=6,
        )

    def _discover(self, function, args) -> list[str]:
        """Trace `function`'s body for `args` without taps (the trace is thrown away); the
        reasons it cannot be split."""
        traced(function.python_function).get_concrete_function(*args)
        return self._recorder.refusals

    def _discovered_shapes(self) -> list[tuple]:
        return [shape for call in self._recorder.calls for shape in call.output_shapes]

    def _tap_specs(self) -> list:
        return [tf.TensorSpec(tap_shapes.specs_shape(s), tf.float32) for s in self._shapes]

    def _tap_zeros(self, function, args: tuple) -> list:
        """Zero taps for a forward of `args` (kept per input shapes: tensors do not change)."""
        inputs = _shapes_of(args[0])
        key = tuple(inputs)
        if key not in self._zeros:
            shapes = tap_shapes.resolve(self._shapes, inputs)
            if shapes is None:  # candidates disagree here: which does the output follow?
                self._discover(function, (*args, None))
                narrowed = tap_shapes.narrow(self._shapes, self._discovered_shapes(), inputs)
                if isinstance(narrowed, str):
                    raise ValueError(
                        f"hyparflow: schedule='zero_bubble' cannot shape this stage's weight "
                        f"taps: {narrowed}; use schedule='1f1b' for this model."
                    )
                self._shapes = narrowed
                shapes = tap_shapes.resolve(self._shapes, inputs)
            if len(self._zeros) >= KEPT_TAP_SHAPES:  # varying lengths: keep the latest few
                del self._zeros[next(iter(self._zeros))]
            self._zeros[key] = [tf.zeros(shape, tf.float32) for shape in shapes]
        return self._zeros[key]

    def _taped_forward(self, inputs, targets, scale, rows, tape):
        if self.is_last:
            y, sample_weight = targets
            function, args = self._split_loss_forward_fn, (inputs, y, sample_weight, scale, rows)
            self._traced_split(function, args, targets=(1, 2))
        else:
            function, args = self._split_forward_fn, (inputs, scale, rows)
            self._traced_split(function, args)
        if not self.split:
            return super()._taped_forward(inputs, targets, scale, rows, tape)
        watched = [t for t in tree.flatten(inputs) if _is_float(t)] if self.input_grads else []
        taps = self._tap_zeros(function, args)
        if tape is not None:
            tape.watch(watched)
            tape.watch(taps)
        if self.is_last:
            y_pred, loss, self.last_added, scaled, self._last_saved = function(*args, taps)
            return (y_pred, loss), (inputs, watched, taps, scaled)
        result, self.last_added, added, self._last_saved = function(*args, taps)
        floats = [t for t in tree.flatten(result) if _is_float(t)]
        if self.has_added_losses:
            floats.append(added)
        return result, (inputs, watched, taps, floats)

    def forward(self, microbatch: int, inputs, targets=None, scale=1.0, rows=None):
        result = super().forward(microbatch, inputs, targets, scale, rows)
        if self.split and not self.recompute:
            self._saved[microbatch] = self._last_saved
        self._last_saved = None  # recomputation saves its own at the backward
        return result

    # --- the two halves of the backward ---------------------------------------------------
    def backward(self, microbatch: int, output_grads=None):
        """B: the gradients of the inputs (returned) and of every tapped output (kept for
        `weight`)."""
        if not self.split:
            return super().backward(microbatch, output_grads)
        tape, kept = self._pending.pop(microbatch)
        if tape is None:
            tape, kept = self._recomputed(*kept)
            saved, self._last_saved = self._last_saved, None
        else:
            saved = self._saved.pop(microbatch)
        inputs, watched, taps, targets = kept
        grads = self._differentiate(tape, targets, watched + taps, output_grads)
        tapped = [_or_zeros(g, t) for g, t in zip(grads[len(watched) :], taps, strict=True)]
        self._owed[microbatch] = (saved, tapped)
        return self._input_gradients(inputs, watched, grads[: len(watched)])

    def weight(self, microbatch: int) -> None:
        """W: the weight gradients of `microbatch`, added to the step's."""
        if not self.split:
            return
        saved, output_grads = self._owed.pop(microbatch)
        if self._weight_fn.experimental_get_tracing_count() == 0:  # once, for any shapes
            self._weight_fn.get_concrete_function(self._saved_specs, self._tap_specs())
        grads = self._weight_fn(saved, output_grads)
        self._accumulate(list(grads), self._sources)

    def _weight_body(self, saved, output_grads):
        return weight_taps.weight_gradients(self._calls, self.variables, saved, output_grads)

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose weight gradients have not been computed yet."""
        return len(self._pending) + len(self._owed)

"""A pipeline stage whose backward runs as two passes: input gradients (B), weight gradients (W).

The zero-bubble schedules (`schedule/zero_bubble.py`) run W after B, in the pipeline's
bubbles; `engine/weight_taps.py` says how a TensorFlow backward is split. A stage that cannot
be split (`Taps.refusals`) runs 1F1B's merged backward at B and nothing at W, which the same
schedule keeps valid: W only ever waits for its own stage's B.
"""

from __future__ import annotations

import warnings

import tensorflow as tf
from keras import tree

from hyparflow.engine import relaxed, weight_taps
from hyparflow.engine.random_slices import slice_of
from hyparflow.engine.stage import StageRunner, _constant, _is_float, _or_zeros
from hyparflow.traced import traced


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
        self.split = bool(self._owners)
        self.refusals: list[str] = []
        self._taps = None  # the Taps of the forward's trace: its calls, what it saves
        self._saved: dict[int, list] = {}  # micro-batch -> its calls' saved arguments
        self._owed: dict[int, tuple] = {}  # micro-batch -> (saved arguments, taps' gradient)
        self._last_saved = None
        self._zeros: dict[int, list] = {}  # rows -> zero taps
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
        self._taps = recorder
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
        """Discover the stage's layer calls (a throwaway trace), then trace `function` once
        with the batch size and varying lengths unknown and a tap per tapped output; the
        stage turns unsplittable, with the reasons, where discovery found one."""
        if function.experimental_get_tracing_count() > 0 or not self.split:
            return
        specs = relaxed.relaxed_specs(args, self.input_shapes, targets)
        traced(function.python_function).get_concrete_function(*specs[:-1], None)
        self.refusals = list(dict.fromkeys(self._taps.refusals))
        if self.refusals:
            self.split = False
            warnings.warn(
                "hyparflow: this stage runs its backward whole (the zero-bubble schedule cannot "
                "split it): " + "; ".join(self.refusals[:3]),
                stacklevel=5,
            )
            return
        function.get_concrete_function(*specs[:-1], weight_taps.tap_specs(self._taps.calls))

    def _tap_zeros(self, rows: int) -> list:
        """Zero taps for a forward of `rows` rows (kept per size: tensors do not change)."""
        if rows not in self._zeros:
            shapes = weight_taps.tap_shapes(self._taps.calls, rows)
            self._zeros[rows] = [tf.zeros(shape, tf.float32) for shape in shapes]
        return self._zeros[rows]

    def _taped_forward(self, inputs, targets, scale, rows, tape):
        if self.is_last:
            y, sample_weight = targets
            function, args = self._split_loss_forward_fn, (inputs, y, sample_weight, scale, rows)
            self._traced_split(function, (*args, None), targets=(1, 2))
        else:
            function, args = self._split_forward_fn, (inputs, scale, rows)
            self._traced_split(function, (*args, None))
        if not self.split:
            return super()._taped_forward(inputs, targets, scale, rows, tape)
        watched = [t for t in tree.flatten(inputs) if _is_float(t)] if self.input_grads else []
        taps = self._tap_zeros(int(tree.flatten(inputs)[0].shape[0]))
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
        if self._weight_fn.experimental_get_tracing_count() == 0:  # once, for any batch size
            specs = [relaxed.rows_unknown_spec(t) for t in saved]
            self._weight_fn.get_concrete_function(specs, weight_taps.tap_specs(self._taps.calls))
        grads = self._weight_fn(saved, output_grads)
        self._accumulate(list(grads), self._sources)

    def _weight_body(self, saved, output_grads):
        return weight_taps.weight_gradients(self._taps.calls, self.variables, saved, output_grads)

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose weight gradients have not been computed yet."""
        return len(self._pending) + len(self._owed)

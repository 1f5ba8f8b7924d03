"""The runner seam: one stage's forward and backward of a micro-batch, gradients summed until taken.

The pipeline walk (`engine/stages/walk.py`) and the gradient reduction (`engine/gradients/sync.py`)
drive any `Runner`: `FusedRunner` (the whole model, forward and backward in one compiled call),
`StageRunner` (a pipeline stage, forward under a tape) and `SegmentedRunner` (a stage cut into
segments whose gradients are final one after another); under interleaved 1F1B the walk drives a
`StageRunner` per model chunk and the reduction one `ChunkRunners` over them
(engine/stages/chunks.py). `RunnerBase` holds what the first two share: the variables split into
dense ones and embedding tables, the layers' added losses, inference, and the tables' row-slice
gradients.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import keras
import tensorflow as tf

from hyparflow.engine import relaxed
from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.traced import traced


class Runner(Protocol):
    """What the walk and the reduction ask of a stage's runner.

    `layout`: None when the gradients come as a list (`take_gradients`), else the `FlatLayout`
    or `BucketedLayout` whose flat tensors `take_flat_gradients` returns, the tables' row
    slices apart (`take_sparse_gradients`). `flat_backward`: the variables are read from one
    packed tensor during the step, packed by `prepare`. `updates_metrics`: the runner updates
    the compiled metrics itself. `slice_gradients`: the dense variables' gradients come as
    this replica's slices, already summed over the replicas (`take_slice_gradients`; ZeRO-3's
    `LayerGathering`). `last_added`: the layers' added loss of the last forward or
    inference; `has_added_losses` once any call added one.
    """

    variables: list
    layout: object | None
    flat_backward: bool
    updates_metrics: bool
    slice_gradients: bool
    last_added: tf.Tensor | None

    @property
    def has_added_losses(self) -> bool: ...

    def forward(self, microbatch: int, inputs, targets=None, scale=1.0, rows=None): ...

    def backward(self, microbatch: int, output_grads=None): ...

    def weight(self, microbatch: int) -> None:
        """The weight half of a split backward (zero-bubble schedules); nothing where
        `backward` computed the weight gradients too."""

    def infer(self, inputs): ...

    def prepare(self) -> None: ...

    def take_gradients(self) -> list: ...


class WeightSource(Protocol):
    """Where a runner reads its dense variables' values from when they hold none between
    calls (ZeRO-3: `ShardedWeights.gather_for`, an all-gather of the replicas' slices)."""

    def __call__(self) -> list:
        """The values now, in the runner's `dense` order (collective)."""

    def prefetch(self) -> None:
        """Start getting them, so that the next call finds them ready."""


class RunnerBase:
    """The part of a runner that is the same whether forward and backward are one compiled call
    (`FusedRunner`) or a taped forward and a later backward (`StageRunner`).

    `call(inputs, training)` computes the stage; `variables` are its trainable variables, of
    which `sparse` are the positions of embedding tables, whose gradients stay row slices: each
    micro-batch's are kept as they come and concatenated in order, or added row by row where
    `row_kinds` says a table's rows come once per batch (`take_sparse_gradients`).
    `added_losses()`, if given, returns (inside a trace) the sum of the losses the layers added
    during the call (`add_loss`, activity regularizers), or None; `last_added` holds its value
    after each forward or inference, and `has_added_losses` turns True once a call added one.
    `train_scope()`, if given, returns a context entered around tracing a training call (e.g.
    BatchNormalization statistics summed across replicas). `input_shapes`: the declared
    shapes of the inputs (`relaxed.declared_shapes`), so that each step function is traced
    once, before its first call, with the batch size and the varying lengths unknown, instead of
    once per micro-batch shape (or, for a model that cannot take a length unknown, once per
    length: `relaxed.Traces`); without them (None), it traces as the data comes, at most twice
    (`reduce_retracing`, as Keras's own train function). `gather` (a `WeightSource`): the
    dense variables hold no values between calls, and each call reads them from it.
    `layer_gathering` (a `LayerGathering`): they hold none either, and each call reads this
    replica's slices, which its layers gather around their own calls inside the graph; the
    backward then gives the slices' gradients (`slice_gradients`).
    """

    def __init__(
        self,
        call,
        variables,
        *,
        sparse=(),
        row_kinds=row_sparse.UNPROBED,
        added_losses=None,
        train_scope=None,
        input_shapes=None,
        gather=None,
        layer_gathering=None,
    ):
        self.variables = list(variables)
        self.sparse = sorted(sparse)
        # which tables' rows come once per batch: their micro-batches add them row by row
        self._per_batch = row_sparse.per_batch_flags(self.variables, self.sparse, row_kinds)
        self.dense = sorted(set(range(len(self.variables))) - set(self.sparse))
        self._gather = gather
        self._layer_gathering = layer_gathering
        self.slice_gradients = layer_gathering is not None
        self._after_gather = None  # what to start once the next gather is read out
        # The tf.Variable behind each Keras variable: what a tape can watch and differentiate
        # (none for variables gathered, whose values are let go between steps).
        gathered = set(self.dense) if gather or layer_gathering else set()
        self._sources = [
            None if i in gathered else getattr(v, "value", v) for i, v in enumerate(self.variables)
        ]
        self._sparse_per_microbatch: list[list] = []  # per micro-batch, the row-sparse gradients
        self._added_losses = added_losses
        self._train_scope = train_scope or contextlib.nullcontext
        self.has_added_losses = False  # set while tracing a call whose layers added a loss
        self.last_added = None
        self._call = call
        self.input_shapes = input_shapes
        self._traces = relaxed.Traces(input_shapes)
        self._grads = None  # the step's summed dense gradients: a list, or flat tensors
        self._infer_fn = traced(self._infer_body, reduce_retracing=True)

    def _added(self):
        added = self._added_losses() if self._added_losses is not None else None
        if added is None:
            return tf.zeros((), tf.float32)
        self.has_added_losses = True
        return added

    def _infer_body(self, inputs, params):
        with self.reading(params):
            outputs = self._call(inputs, False)
            return outputs, self._added()

    @property
    def gathers(self) -> bool:
        """Whether each call reads the dense variables' values from `gather`."""
        return self._gather is not None

    def prefetch(self) -> None:
        """Start getting the dense variables' values for the next call from `gather`, so that
        the transfer runs while something else computes; nothing without one."""
        if self._gather is not None:
            self._gather.prefetch()

    def after_gather(self, action) -> None:
        """Run `action()` once, as soon as the next call has its values from `gather` (e.g.
        start the next runner's `prefetch`: after, not before, this one's values are read
        out, so that at most two runners' gathered weights exist at once)."""
        self._after_gather = action

    def gathered(self):
        """The dense variables' values from `gather` (None without one)."""
        if self._gather is None:
            return None
        values = self._gather()
        action, self._after_gather = self._after_gather, None
        if action is not None:
            action()
        return values

    def slices(self) -> list:
        """This replica's slices of the dense variables now (with a `layer_gathering`)."""
        return self._layer_gathering.slices()

    @contextlib.contextmanager
    def reading(self, values, replay=contextlib.nullcontext):
        """Inside a trace: the dense variables read `values` (in `dense` order; None: their
        own), and what the call assigns to any variable (statistics, seeds) is assigned after.
        With a `layer_gathering`, `values` are the slices its layers gather from, and
        `replay()` the contexts their recomputations run in."""
        if values is None:
            yield
            return
        if self._layer_gathering is not None:
            with self._layer_gathering.reading(values, replay):
                yield
            return
        dense = [self.variables[i] for i in self.dense]
        with UpdateRecordingScope(zip(dense, values, strict=True)) as scope:
            yield
        scope.assign_updates()

    def _relaxed(self, function, args: tuple, targets: tuple = ()):
        """What to call for `function(*args)`: `function`, once traced with the batch size and
        the varying dimensions of `args` unknown, or its copy traced per length where that
        trace raised (`relaxed.Traces`; without declared inputs, as the data comes)."""
        return self._traces.ready(function, args, targets)

    def weight(self, microbatch: int) -> None:
        """Nothing: this runner's backward computes the weight gradients too."""

    def infer(self, inputs):
        """Forward without gradients, in inference mode (validation, evaluate, predict)."""
        args = (inputs, self.slices() if self.slice_gradients else self.gathered())
        outputs, self.last_added = self._relaxed(self._infer_fn, args)(*args)
        return outputs

    def take_sparse_gradients(self) -> list:
        """The embedding tables' gradients since the last call, in `sparse` order."""
        per_microbatch, self._sparse_per_microbatch = self._sparse_per_microbatch, []
        return row_sparse.concat_microbatches(
            per_microbatch, self.sparse, self.variables, self._per_batch
        )

    @property
    def _totals_are_flat(self) -> bool:
        """Whether the step's summed dense gradients (`_grads`) are the layout's flat tensors."""
        raise NotImplementedError

    def _zero_dense(self) -> list:
        """Zeros for each dense variable's gradient (no micro-batch summed yet)."""
        return [tf.zeros(self.variables[i].shape, self.variables[i].dtype) for i in self.dense]

    def take_gradients(self) -> list:
        """Summed variable gradients of the micro-batches since the last call (zeros if none);
        row slices concatenated for the embedding tables."""
        dense = self.take_dense_gradients()
        tables = self.take_sparse_gradients()
        return row_sparse.in_order(len(self.variables), self.dense, dense, self.sparse, tables)

    def take_dense_gradients(self) -> list:
        """The summed gradients of the `dense` variables since the last call (zeros if none),
        in `dense` order; the tables' row slices stay for `take_sparse_gradients`."""
        if self._totals_are_flat:
            return list(self.layout.unflatten_fn(self.take_flat_gradients()))
        dense, self._grads = self._grads, None
        return self._zero_dense() if dense is None else dense


class UpdateRecordingScope(keras.StatelessScope):
    """A `keras.StatelessScope` that also remembers which variables were assigned in it."""

    def __init__(self, mapping):
        super().__init__(list(mapping), collect_losses=True, initialize_variables=False)
        self.updates = {}

    def add_update(self, update):
        super().add_update(update)
        self.updates[id(update[0])] = update

    def assign_updates(self) -> None:
        """Do the assignments the scope collected (after it is left)."""
        for variable, value in self.updates.values():
            variable.assign(value)

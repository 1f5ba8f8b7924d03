"""Every optimizer a model's own step applies, each stepping this replica's slices of the
variables the step applies it to (ZeRO-1/2/3 under engine/custom_step.py).

While the step is traced, each optimizer's `apply` stands for `StepOptimizers.replacing`: the
first call for an optimizer tells which variables the step applies it to, and the slices are
made then (`tf.init_scope`: built eagerly, once, whatever the trace): the compiled optimizer
applied to every trainable variable steps the trainer's own slices (`ShardedUpdate`, under
ZeRO-3 the weight slices themselves: as fast as with one optimizer); any other optimizer, or
the compiled one applied to part of the model, gets an `OptimizerSlices` of its variables.
Every replica traces the same step, so each finds the same optimizers and variables, and what
cannot be sliced exactly is refused alike on every replica, while tracing (`AgreedError`).

Under ZeRO-3 the weight slices are the truth between steps: the step runs between `fill`
(gathered into the variables) and `empty`. An optimizer with slices of its own loads them from
the variables and all-gathers its update into them; where one did, the step's end writes each
replica's part of the variables into its weight slices (a local copy), and the compiled
optimizer on every variable loads the weight slices from the variables first when another
update came before it in the step.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from hyparflow.comm.agree import AgreedError
from hyparflow.engine.sharded_optimizer.in_step import SlicedApply
from hyparflow.engine.sharded_optimizer.optimizer_slices import OptimizerSlices


class StepOptimizers:
    """The sliced applies of a model's own step. `sharded`: the trainer's `ShardedUpdate` of
    the whole model (ZeRO-3: its groups are the weight slices); `comm`, `traffic`, `guard`: as
    `SlicedApply`'s; `refusal(optimizer)`: why an optimizer cannot be sliced exactly (None if
    it can); `slices_only`: ZeRO-3; `on_compiled(slices)`: told the `OptimizerSlices` of the
    compiled optimizer where the step applies it to part of the model (checkpoints read
    those).

    Example:
        steps = StepOptimizers(sharded, comm, traffic, guard, refusal)
        with Replaced((o, "apply", lambda apply, o=o: steps.replacing(o, apply, weight))
                      for o in optimizers):
            model.train_step(data)  # traced: each optimizer steps its own slices
    """

    def __init__(self, sharded, comm, traffic, guard, refusal, slices_only=False, on_compiled=None):
        self.sharded = sharded
        self.whole = SlicedApply(sharded, comm, traffic, guard, slices_only)
        self.slices_only = slices_only
        self._wiring = (comm, traffic, guard)
        self._refusal = refusal
        self._on_compiled = on_compiled or (lambda slices: None)
        self._applies: dict = {}  # id(optimizer) -> its SlicedApply
        # in a trace under ZeRO-3: an update since the weight slices last were (fill, or the
        # compiled optimizer on every variable) wrote the variables
        self._rewritten = False

    def others(self) -> list:
        """The `OptimizerSlices` of every optimizer the step applies but the compiled one."""
        compiled = self.sharded.optimizer
        return [
            applied.sharded
            for applied in self._applies.values()
            if applied is not self.whole and applied.optimizer is not compiled
        ]

    def fill(self) -> None:
        """Inside a trace, ZeRO-3's step begins: the variables take the weight slices."""
        self._rewritten = False
        self.whole.fill()

    def empty(self) -> None:
        """Inside a trace, ZeRO-3's step ends: the weight slices take what other optimizers
        wrote into the variables, which let their values go."""
        if self._rewritten:
            self.sharded.load_slices()
        self.whole.empty()

    def replacing(self, optimizer, apply, weight):
        """What stands for `optimizer`'s `apply` (its method) while a step is traced, this
        replica's gradients weighted by `weight` (a tensor: its share of the global batch)."""
        return functools.partial(self._apply, optimizer, apply, weight)

    def _apply(self, optimizer, apply, weight, grads, trainable_variables=None):
        variables = self.sharded.variables if trainable_variables is None else trainable_variables
        variables = list(variables)
        sliced = self._sliced_for(optimizer, variables)
        if sliced is self.whole and self.slices_only and self._rewritten:
            self.sharded.load_slices()  # an update earlier in the step wrote the variables
        sliced.replacing(apply, weight)(grads, variables)
        self._rewritten = sliced is not self.whole

    def _sliced_for(self, optimizer, variables: list) -> SlicedApply:
        """`optimizer`'s `SlicedApply`, made at its first apply for `variables`."""
        applied = self._applies.get(id(optimizer))
        if applied is None:
            with tf.init_scope():  # slices and slots are made once, eagerly
                applied = self._applies[id(optimizer)] = self._made_for(optimizer, variables)
        if _ids(applied.variables) != _ids(variables):
            raise AgreedError(
                ValueError(
                    f"The model's own step applies {type(optimizer).__name__} "
                    f"({optimizer.name}) to {len(variables)} variables that are not the "
                    f"{len(applied.variables)} it applied it to before; sharding its state "
                    "builds it once, for the slices of one set of variables. Apply each "
                    "optimizer to one set of variables (an optimizer per set), or leave the "
                    "optimizer state unsharded."
                )
            )
        return applied

    def _made_for(self, optimizer, variables: list) -> SlicedApply:
        """`optimizer`'s `SlicedApply` over `variables`, its state built (refused, alike on
        every replica, where it cannot be sliced or was built before)."""
        why = self._refusal(optimizer)
        if why:
            raise AgreedError(ValueError(why))
        compiled = optimizer is self.sharded.optimizer
        try:
            if compiled and _ids(variables) == _ids(self.sharded.variables):
                self.sharded.build_optimizer()
                return self.whole
            prefix = f"hyparflow_zero_opt{len(self._applies)}"
            slices = OptimizerSlices(optimizer, variables, self._wiring[0], prefix)
            slices.build_optimizer()
        except ValueError as error:
            raise AgreedError(error) from None  # the same on every replica
        if compiled:
            self._on_compiled(slices)
        return SlicedApply(slices, *self._wiring)


def _ids(variables) -> set:
    return {id(v) for v in variables}

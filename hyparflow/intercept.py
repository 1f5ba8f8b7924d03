"""The one way hyparflow replaces a method or function for a while: a layer instance's `call`
(tensor shards, sparse expert dispatch, weight taps, traffic counting), an optimizer's `apply`
(a model's own train step), Keras's random functions (dropout masks sliced from the global
batch's), a per-output loss Mean's `update_state` (weighted by the global batch) and
BatchNormalization's moments (taken over the replicas).

`Replaced([(target, name, make), ...])` sets each `target.name` to `make(previous)`, where
`previous` is what the attribute gave before: an instance's own value (a call the user or
another part of hyparflow set), else the class's method bound to the instance, or a module's
function. On exit it puts back exactly what was there: the instance's own value, or nothing,
so that the class's method shows again. Entered again inside itself it keeps the replacements
until its outermost exit; replacements of one attribute by several holders nest, each putting
back what it found. Attributes are set past Keras's tracking (`object.__setattr__`), so a
replaced call is never tracked or saved as part of a layer. `tests/test_intercept.py` fails if
another module of hyparflow sets or deletes such an attribute itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

_ABSENT = object()  # the target had no value of its own: its class's shows


class Replaced:
    """Attributes replaced while the context is active (re-entrant), put back exactly on exit.

    Example:
        >>> class Layer:
        ...     def call(self, x):
        ...         return x + 1
        >>> layer = Layer()
        >>> doubled = Replaced([(layer, "call", lambda previous: lambda x: 2 * previous(x))])
        >>> with doubled:
        ...     with doubled:  # entered again: the same replacement, not a second one
        ...         inside = layer.call(1)
        >>> inside, layer.call(1), "call" in vars(layer)
        (4, 2, False)
    """

    def __init__(self, replacements: Iterable[tuple[object, str, Callable]]):
        self._replacements = list(replacements)
        self._found: list[tuple[object, str, object]] = []
        self._depth = 0

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            try:
                for target, name, make in self._replacements:
                    own = vars(target).get(name, _ABSENT)
                    object.__setattr__(target, name, make(getattr(target, name)))
                    self._found.append((target, name, own))
            except BaseException:
                self._put_back()
                self._depth = 0
                raise
        return self

    def __exit__(self, *exc) -> bool:
        self._depth -= 1
        if self._depth == 0:
            self._put_back()
        return False

    def _put_back(self) -> None:
        for target, name, own in reversed(self._found):
            if own is _ABSENT:
                object.__delattr__(target, name)
            else:
                object.__setattr__(target, name, own)
        self._found = []


def replaced_calls(calls: Iterable[tuple[object, Callable]]) -> Replaced:
    """`Replaced` for layers' `call`: `calls` holds (layer, make), `make(previous)` the call."""
    return Replaced((layer, "call", make) for layer, make in calls)


def instead(value) -> Callable:
    """A `make` that ignores what was there: the replacement does not call it.

    Example:
        >>> instead(print)(len) is print
        True
    """
    return lambda previous: value

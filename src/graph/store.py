"""The per-run object store: intermediate values by reference, awaited by name.

Values stay Python objects (tensors stay tensors); nothing is serialised. A
reader awaits a variable until its producer has set it, which lets a primitive
inside a streamed region wait for a value produced outside it. A region scope
overlays one piece's values on the run's store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio


@dataclass(frozen=True)
class Failed:
    """The value of a variable whose producer failed: its readers fail with ``error`` instead of waiting forever."""

    error: str


class Store:
    def __init__(self, initial: dict[str, Any] | None = None, parent: Store | None = None,
                 declares: set[str] | frozenset[str] = frozenset()) -> None:
        self._values: dict[str, Any] = dict(initial or {})
        self._events: dict[str, anyio.Event] = {}
        self.parent = parent
        self.declares = declares  # variables the primitives of this scope will set

    def _event(self, var: str) -> anyio.Event:
        if var not in self._events:
            self._events[var] = anyio.Event()
            if var in self._values:
                self._events[var].set()
        return self._events[var]

    def has(self, var: str) -> bool:
        return var in self._values or (self.parent is not None and self.parent.has(var))

    def set(self, var: str, value: Any) -> None:
        self._values[var] = value
        self._event(var).set()

    def peek(self, var: str, default: Any = None) -> Any:
        if var in self._values:
            return self._values[var]
        return self.parent.peek(var, default) if self.parent is not None else default

    async def get(self, var: str) -> Any:
        """The value of ``var`` here or in an enclosing scope, once someone has set it."""
        scope: Store | None = self
        while scope is not None:
            if var in scope._values:
                return scope._values[var]
            scope = scope.parent
        # Not set yet: wait in the nearest scope whose primitives produce it.
        owner = self
        while var not in owner.declares:
            if owner.parent is None:
                raise KeyError(f"no value and no producer for {var!r}")
            owner = owner.parent
        await owner._event(var).wait()
        return owner._values[var]

    def child(self, values: dict[str, Any], declares: set[str]) -> Store:
        return Store(values, parent=self, declares=declares)

    def clear(self) -> None:
        self._values.clear()

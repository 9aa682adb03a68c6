"""Waiters: where a finished request's output goes, with requests arriving from threads.

The engine's request API is thread-safe (`Engine`: one fair lock), so the request a
`generate()` call waits for may finish in a step another thread runs, and a `step()`
may finish requests no one there asked for. The rule, in one place:

    a request some generate() awaits   its output waits here for that call
                                       (`claim`, then `ready`)
    any other                          returned by the step that finished it, or, if
                                       that step ran inside a generate(), held for the
                                       next step() (`hold`, then `take_held`)
    a generate() that leaves           its parked outputs go with it (`forget`)

Not thread-safe itself: the engine calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcache.engine.request import GenerationOutput


class Waiters:
    """The requests some generate() call awaits, the outputs parked for them, and the
    outputs held for the next step(). Mutated only through its methods."""

    def __init__(self) -> None:
        self._awaited: set[int] = set()
        self._parked: dict[int, GenerationOutput] = {}  # awaited requests' outputs
        self._held: list[GenerationOutput] = []  # others', for the next step()

    def expect(self, request_ids: Iterable[int]) -> None:
        """A generate() call awaits `request_ids` from now on."""
        self._awaited.update(request_ids)

    def forget(self, request_ids: Iterable[int]) -> None:
        """The generate() call that awaited `request_ids` left: no longer awaited, their
        parked outputs dropped."""
        for request_id in request_ids:
            self._awaited.discard(request_id)
            self._parked.pop(request_id, None)

    def claim(self, outputs: Iterable[GenerationOutput]) -> list[GenerationOutput]:
        """Park the `outputs` some generate() awaits; returns the others, in order."""
        others = []
        for out in outputs:
            if out.request_id in self._awaited:
                self._parked[out.request_id] = out
            else:
                others.append(out)
        return others

    def hold(self, outputs: Iterable[GenerationOutput]) -> None:
        """`claim` the `outputs`, and hold the others for the next step()."""
        self._held += self.claim(outputs)

    def take_held(self) -> list[GenerationOutput]:
        """The held outputs, oldest first; none are held after."""
        held, self._held = self._held, []
        return held

    def has_output(self, request_id: int) -> bool:
        """Whether awaited request `request_id` finished (its output is parked)."""
        return request_id in self._parked

    def ready(self, request_ids: list[int]) -> list[GenerationOutput] | None:
        """The parked outputs of `request_ids`, in that order, once every one finished;
        None before."""
        if all(r in self._parked for r in request_ids):
            return [self._parked[r] for r in request_ids]
        return None

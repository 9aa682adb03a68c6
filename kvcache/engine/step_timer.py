"""StepTimer: where an engine step's wall time goes, phase by phase.

    timer = StepTimer()
    engine.step_timer = timer      # the engine laps it inside every step it runs
    engine.step(); engine.step()
    timer.steps[-1].overhead       # everything but the forward, in seconds

Phases, in step order: schedule (admission with reuse, chunking, block copies: the
engine's), metadata (starting recurrent states, paged metadata, input ids, step context),
plan (the backend's per-step plan), forward (the model), sample (greedy tokens, the
logits to the host: the step runner's), commit (the scheduler's postprocess: cache
commit, kept logits, blocks for the next token, table rows, finished and preempted
requests). A CUDA-graph step plans inside its replay, so there its plan counts as
forward. Steps that schedule nothing are not kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

Phase = Literal["schedule", "metadata", "plan", "forward", "sample", "commit"]
PHASES: tuple[Phase, ...] = get_args(Phase)
_INDEX = {phase: i for i, phase in enumerate(PHASES)}


class StepTimes(NamedTuple):
    """Seconds one step spent in each phase."""

    schedule: float
    metadata: float
    plan: float
    forward: float
    sample: float
    commit: float

    @property
    def total(self) -> float:
        """The whole step."""
        return sum(self)

    @property
    def overhead(self) -> float:
        """Everything but the forward."""
        return self.total - self.forward


class StepTimer:
    """Collects a StepTimes per engine step (laps of `clock`, seconds, by default
    time.perf_counter: a small share of a step). Tests pass a clock of their own, so
    what they assert about laps does not depend on how fast the machine is."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.steps: list[StepTimes] = []
        self._clock = clock
        self._laps = [0.0] * len(PHASES)
        self._last = 0.0

    def start(self) -> None:
        """A step begins: laps from here on belong to it."""
        self._laps = [0.0] * len(PHASES)
        self._last = self._clock()

    def lap(self, phase: Phase) -> None:
        """Charge the time since the previous lap (or start) to `phase`."""
        now = self._clock()
        self._laps[_INDEX[phase]] += now - self._last
        self._last = now

    def finish(self) -> None:
        """The step ended: keep its times."""
        self.steps.append(StepTimes(*self._laps))

    def clear(self) -> None:
        """Forget the steps kept so far."""
        self.steps.clear()

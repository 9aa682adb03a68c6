"""StepTimer: the engine laps every phase of every step it runs, and only those steps."""

from __future__ import annotations

import time

from kvcache import Engine, KvCacheConfig
from kvcache.engine.step_timer import PHASES, StepTimer, StepTimes


def test_times_add_up() -> None:
    t = StepTimes(schedule=1.0, metadata=2.0, plan=3.0, forward=10.0, sample=4.0, commit=5.0)
    assert (t.total, t.overhead) == (25.0, 15.0)
    assert StepTimes._fields == PHASES


def test_laps_charge_the_time_since_the_previous_one() -> None:
    # A clock of its own: the readings at start and at each lap, whatever the machine.
    readings = iter([10.0, 10.5, 10.75, 12.0])
    timer = StepTimer(clock=lambda: next(readings))
    timer.start()
    timer.lap("metadata")  # 0.5 s since the start
    timer.lap("forward")  # 0.25 s
    timer.lap("metadata")  # 1.25 s more: a phase lapped twice sums both
    timer.finish()
    assert timer.steps == [StepTimes(schedule=0.0, metadata=1.75, plan=0.0, forward=0.25,
                                     sample=0.0, commit=0.0)]
    timer.clear()
    assert timer.steps == []


def test_engine_laps_every_phase_of_each_step() -> None:
    cfg = KvCacheConfig(tokens_per_block=4, max_num_blocks=32)
    engine = Engine("tiny", cfg, max_num_tokens=8)
    timer = StepTimer()
    engine.step_timer = timer
    engine.add_request(list(range(1, 11)), max_new_tokens=2)  # chunks 8 + 2, then a decode
    walls = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    engine.step()  # idle: schedules nothing, keeps nothing
    assert engine.idle
    assert len(timer.steps) == len(walls) == 3
    for step, wall in zip(timer.steps, walls, strict=True):
        assert all(t > 0.0 for t in step), step  # every phase ran (eager: plan included)
        assert step.total <= wall

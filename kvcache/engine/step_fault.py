"""The step's fault-injection seam: named points where a test's hook may raise.

`Engine.step_fault` (None, the default: nothing is called, one `is None` test a point)
is called with a phase's name at each point below, in the order a step reaches them;
whatever it raises (a RuntimeError, as CUDA out of memory is; a KeyboardInterrupt) the
step raises there, as a real failure at that point would. A test's fault plan numbers
the calls of each phase and raises at the ones it chose
(tests/reliability/test_step_faults.py), so the suite names phases, never the engine's
methods, and survives their renames. The core's own seam is `state.allocation_fault`
(kvcache/core/state.py).

What a failure at each point means (docs/design.md, "A step is all or nothing"):

    phase      the point                                  a failure there
    schedule   a step starts scheduling                   the step did not happen
    admit      before the cache admits a request          it stays first in the queue
    join       the cache admitted it; before its slot,    the admission is undone: rows
               table row and batch row                    taken back, the cache's
                                                          admission given back, the
                                                          request first in the queue
    copy       before the storage applies each op         the ops applied are
                                                          acknowledged, the rest stay
                                                          queued; the step did not happen
    plan       before the backend plans the step (or a    the step did not happen: the
               CUDA graph replays)                        batch is recounted, no request
    attention  an attention layer appended its KV and     took a state, no counter moved
               attended
    recurrent  a recurrent layer computed every
               request's state (kept by the step)
    sample     before sampling (the step's first host
               sync: where a deferred CUDA error lands)
    commit     before the cache commits a chunk's         the step happened: its
               tokens (and the request takes its token)   postprocess stops there and is
    append     before the cache appends a sampled token   completed, from that point, by
    release    before a finished request is released      the engine's next call
    preempt    before a request is preempted (also the
               windowed scheduler's, which then did not
               happen)
    sync       before a running request's table and
               batch rows follow its handle
    abort      before abort() (or a failed generate())    the request is where it was
               takes a request out
"""

from __future__ import annotations

from collections.abc import Callable

# Called with a phase's name (one of STEP_PHASES); raises to fail the step there.
StepFault = Callable[[str], None]

STEP_PHASES = ("schedule", "admit", "join", "copy", "plan", "attention", "recurrent",
               "sample", "commit", "append", "release", "preempt", "sync", "abort")

"""Waiters: a finished output goes to the generate() awaiting it, else to the next step()."""

from __future__ import annotations

from kvcache.engine.request import FinishReason, GenerationOutput
from kvcache.engine.waiters import Waiters


def output(request_id: int) -> GenerationOutput:
    return GenerationOutput(request_id, (1,), [2], None, 0, None, FinishReason.LENGTH)


def test_awaited_outputs_wait_for_their_call_and_the_rest_for_the_next_step() -> None:
    waiters = Waiters()
    waiters.expect([1, 2])
    assert waiters.claim([output(0), output(1)]) == [output(0)]  # 0 is nobody's
    assert waiters.ready([1, 2]) is None and waiters.has_output(1)
    waiters.hold([output(2), output(3)])  # a step inside generate(): 3 waits for step()
    waiters.hold([output(4)])
    assert waiters.ready([2, 1]) == [output(2), output(1)]  # in the order asked
    assert waiters.take_held() == [output(3), output(4)] and waiters.take_held() == []


def test_a_call_that_leaves_takes_its_outputs_with_it() -> None:
    waiters = Waiters()
    waiters.expect([5, 6])
    waiters.hold([output(5)])
    waiters.forget([5, 6])
    assert not waiters.has_output(5) and waiters.ready([5]) is None
    waiters.hold([output(6)])  # no longer awaited: the next step() returns it
    assert waiters.take_held() == [output(6)]

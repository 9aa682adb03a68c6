"""FairLock: waiters get the lock in arrival order, ahead of a holder that comes back.

Order is made deterministic by starting each waiter only once the previous one is queued
(`num_waiting`); timeouts only guard against a deadlock hanging the run.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import pytest

from kvcache.engine.fair_lock import FairLock

GUARD_SECONDS = 30


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition`; fail (rather than hang) if it never holds."""
    deadline = time.monotonic() + GUARD_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def queue_waiters(lock: FairLock, names: list[str], order: list[str],
                  already: int = 0) -> list[threading.Thread]:
    """Start one thread per name, each queued for `lock` (behind `already` waiters) before
    the next starts; each appends its name to `order` once it holds the lock."""
    def take(name: str) -> None:
        with lock:
            order.append(name)

    threads = []
    for i, name in enumerate(names):
        thread = threading.Thread(target=take, args=(name,), daemon=True)
        thread.start()
        wait_until(lambda n=already + i + 1: lock.num_waiting == n, f"{name} queued")
        threads.append(thread)
    return threads


def join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(GUARD_SECONDS)
        assert not thread.is_alive(), "a waiter never got the lock"


def test_waiters_are_served_in_arrival_order_before_a_returning_holder() -> None:
    lock = FairLock()
    order: list[str] = []
    lock.acquire()
    threads = queue_waiters(lock, ["a", "b", "c"], order)
    lock.release()
    lock.acquire()  # the step-loop pattern: straight back, but behind every waiter
    order.append("holder")
    lock.release()
    join(threads)
    assert order == ["a", "b", "c", "holder"]
    assert lock.num_waiting == 0


def test_reentrant_and_released_by_its_holder_only() -> None:
    lock = FairLock()
    order: list[str] = []
    with lock, lock:  # nested: the inner release keeps it held
        threads = queue_waiters(lock, ["waiter"], order)
    join(threads)
    assert order == ["waiter"]
    with pytest.raises(RuntimeError, match="the calling thread does not hold the lock"):
        lock.release()
    errors: list[BaseException] = []
    with lock:
        other = threading.Thread(target=lambda: errors.extend(_release_raises(lock)))
        other.start()
        other.join(GUARD_SECONDS)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    with lock:  # still usable
        order.append("again")
    assert order == ["waiter", "again"]


def _release_raises(lock: FairLock) -> list[BaseException]:
    try:
        lock.release()
    except RuntimeError as exc:
        return [exc]
    return []


class Interrupted(Exception):
    """Raised by the test's signal handler inside a blocked acquire."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers run in the main thread only")
def test_an_interrupted_waiter_leaves_the_queue() -> None:
    """A waiter interrupted (Ctrl-C in a notebook) must not block those behind it."""
    lock = FairLock()
    order: list[str] = []
    main = threading.main_thread().ident
    assert main is not None
    behind: list[threading.Thread] = []

    def holder() -> None:
        with lock:
            wait_until(lambda: lock.num_waiting == 1, "the main thread queued")
            behind.extend(queue_waiters(lock, ["behind"], order, already=1))
            signal.pthread_kill(main, signal.SIGUSR1)
            wait_until(lambda: lock.num_waiting == 1, "the interrupted waiter left")

    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        thread = threading.Thread(target=holder, daemon=True)
        thread.start()
        with pytest.raises(Interrupted):
            lock.acquire()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    join([thread, *behind])
    assert order == ["behind"]
    assert lock.num_waiting == 0

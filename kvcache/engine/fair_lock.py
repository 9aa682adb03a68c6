"""FairLock: a reentrant lock granted to waiting threads in arrival order.

`threading.RLock` is not fair: a thread that releases it and takes it again at once (the
engine's step loop does, every step) nearly always beats the threads already waiting,
so an `add_request` or `abort` from another thread could wait until all work drained.
Here a thread that finds the lock held or already queued for joins the back of a queue,
and a release hands the lock to the queue's head; the releasing thread, coming back,
queues behind everyone who arrived meanwhile. A waiter therefore gets in as soon as the
critical section in progress (one engine step) ends.
"""

from __future__ import annotations

import threading
from collections import deque
from types import TracebackType


class FairLock:
    """A reentrant mutex whose waiters acquire it first come, first served.

    Use it as a context manager. `acquire` blocks; a waiter interrupted by an exception
    (KeyboardInterrupt in the main thread) leaves the queue, so it never blocks others.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None  # thread ident of the holder
        self._depth = 0  # the holder's nested acquisitions
        self._queue: deque[int] = deque()  # idents of waiting threads, oldest first

    @property
    def num_waiting(self) -> int:
        """How many threads are queued for the lock now (a snapshot, for introspection)."""
        with self._cond:
            return len(self._queue)

    def acquire(self) -> None:
        """Take the lock, after every thread that was already waiting for it."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            self._queue.append(me)
            try:
                while self._owner is not None or self._queue[0] != me:
                    self._cond.wait()
            except BaseException:
                self._queue.remove(me)
                self._cond.notify_all()  # if it was the head, the next waiter may go
                raise
            self._queue.popleft()
            self._owner, self._depth = me, 1

    def release(self) -> None:
        """Give the lock up (the outermost release hands it to the oldest waiter).

        Raises RuntimeError if the calling thread does not hold it.
        """
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock.release: the calling thread does not hold the lock")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

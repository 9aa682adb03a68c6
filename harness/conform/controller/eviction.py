"""The eviction order a contract states, followed block by block over the harness log.

`FreeQueue` is the policy "lru-blocks-tail-first" (vLLM's `FreeKVCacheBlockQueue`), kept
by block id, written from the policy's words, not from vLLM's code: every block starts
free, in id order (1 first: 0 is the null block); an admission first takes its reused
blocks out of the queue (those nobody held), then takes its new blocks from the front of
the queue, and a taken block that held a cached block evicts it; a free (or a
preemption) puts the sequence's blocks nobody else holds back at the end, its last block
first; an explicit `evict(n)` drops the cached blocks of the first n cached queue
entries, which stay in the queue. Under "lru-blocks-tail-first-uncached-first" a freed
block that caches nothing goes to the front instead (in the same order), to be reused
before any cached block. So it predicts both the ids an allocation gets and
which cached blocks it evicts: the judge's "eviction" oracle checks the first, and the
count oracle stays exact after an eviction by forgetting the second.

A cached block is named as the reuse oracle names it: (scope, every token through it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable
from typing import Any, NamedTuple

from harness.conform.ops import Op

Key = tuple[Hashable, tuple[int, ...]]


class Step(NamedTuple):
    """What one log event did under the policy: `problem` (None: as the policy says)
    and the cached blocks that left the cache (no other copy of them is cached)."""

    problem: str | None
    evicted: tuple[Key, ...]


class FreeQueue:
    """vLLM's free queue over `num_blocks` blocks (mutated by `apply` and `evict`)."""

    def __init__(self, num_blocks: int, block_size: int, uncached_first: bool) -> None:
        self.block_size = block_size
        self.uncached_first = uncached_first
        self.queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))
        self.holders: Counter[int] = Counter()
        self.key: dict[int, Key] = {}  # block id -> the cached block it holds
        self.copies: Counter[Key] = Counter()  # a block cached twice is two ids
        self._seqs: dict[Hashable, tuple[Hashable, list[int], list[int]]] = {}

    def apply(self, ev: Any) -> Step:
        """Follow one normalised log event (`harness.oracle.types.Event`)."""
        if ev.kind == "admit":
            reused = ev.num_tokens // self.block_size
            ids = [b for b in ev.block_ids if b is not None]
            self._seqs[ev.seq_id] = (ev.scope, list(ev.tokens), ids)
            for b in ids[:reused]:
                self._hold(b)
            return self._take(ids[reused:], f"admission of {ev.seq_id!r}")
        seq = self._seqs.get(ev.seq_id)
        if seq is None:
            return Step(None, ())
        scope, tokens, ids = seq
        if ev.kind == "append":
            tokens += ev.tokens
            new = [b for b in ev.block_ids if b is not None]
            ids += new
            return self._take(new, f"append to {ev.seq_id!r}")
        if ev.kind == "commit":
            for i in range(min(ev.num_tokens, len(tokens)) // self.block_size):
                if i < len(ids) and ids[i] not in self.key:
                    self.key[ids[i]] = (scope, tuple(tokens[:(i + 1) * self.block_size]))
                    self.copies[self.key[ids[i]]] += 1
            return Step(None, ())
        if ev.kind == "free":
            del self._seqs[ev.seq_id]
            front: list[int] = []
            for b in reversed(ids):
                self.holders[b] -= 1
                if self.holders[b]:
                    continue
                del self.holders[b]
                if self.uncached_first and b not in self.key:
                    front.append(b)
                else:
                    self.queue[b] = None
            for b in reversed(front):
                self.queue[b] = None
                self.queue.move_to_end(b, last=False)
        return Step(None, ())

    def evict(self, op: Op, evicted: int) -> tuple[Key, ...]:
        """An explicit `evict` op that evicted `evicted` blocks: the cached blocks of the
        first that many cached queue entries lose their keys."""
        out: list[Key] = []
        for b in [b for b in self.queue if b in self.key][:evicted]:
            out += self._drop(b)
        return tuple(out)

    def _hold(self, b: int) -> None:
        if not self.holders[b]:
            self.queue.pop(b, None)
        self.holders[b] += 1

    def _take(self, new: list[int], what: str) -> Step:
        front = list(self.queue)[:len(new)]
        if new != front:
            return Step(f"{what} got blocks {new}; the free queue's front is {front} "
                        "(the least recently freed, a request's last block first)", ())
        out: list[Key] = []
        for b in new:
            del self.queue[b]
            self.holders[b] += 1
            out += self._drop(b)
        return Step(None, tuple(out))

    def _drop(self, b: int) -> list[Key]:
        key = self.key.pop(b, None)
        if key is None:
            return []
        self.copies[key] -= 1
        if self.copies[key]:
            return []
        del self.copies[key]
        return [key]

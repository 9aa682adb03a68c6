"""Scheduler: a per-step token budget over admission with reuse and chunked prefill.

Each step, running requests take the budget first (decodes before prefill chunks, in
admission order), then waiting requests are admitted in arrival order while a batch
slot, token budget and blocks remain. Admission is one walk of the cache: the manager
plans it (what the prompt reuses, what it needs, whether that fits) and the scheduler
admits that plan or, when it does not fit, leaves the request waiting; nothing is
half-admitted.

The running requests are the rows of a PersistentBatch, in admission order: the
scheduler tells it who joins and who leaves, and a step's chunks come in row order.

Under a sliding window the cache allocates prompt blocks chunk by chunk: admission gets
the blocks of the first chunk, and each later chunk reserves its own, computing fewer
tokens when the pool is short. A step in which no running request can get a block
preempts the last of them, so the others can go on. Released blocks leave the front of
a request's table row, and their pages the front of its batch row (release_front).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from kvcache.attention.block_table import BlockTable
from kvcache.core.manager import KVCacheManager
from kvcache.engine.prefix_sharing import leader_of

if TYPE_CHECKING:  # request.py and the batch's metadata need torch; the scheduler does not
    from kvcache.attention.persistent.batch import PersistentBatch
    from kvcache.engine.request import Request


class Chunk(NamedTuple):
    """`num_new` tokens of `req` to compute this step; `samples` if they reach its end."""

    req: Request
    num_new: int
    samples: bool


class Schedule(NamedTuple):
    """One step's work: `chunks` in row order (the running order), and `row_tokens`, the
    new tokens of every running request (0: it sits the step out), or None when each
    computes exactly one (a decode step; PersistentBatch.step's fast path)."""

    chunks: list[Chunk]
    row_tokens: list[int] | None


class Scheduler:
    """Owns the waiting queue, the running set, their batch slots and batch rows."""

    def __init__(self, manager: KVCacheManager, table: BlockTable,
                 batch: PersistentBatch, *, max_num_tokens: int, max_batch_size: int,
                 chunked: bool, share_prefixes: bool = True) -> None:
        self.manager = manager
        self.table = table
        self.batch = batch
        self.windowed = manager.config.sliding_window is not None
        self.max_num_tokens = max_num_tokens
        self.chunked = chunked
        # hold siblings back until a running request commits their common prefix
        self.share_prefixes = share_prefixes and manager.reuse
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_batch_size - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> Schedule:
        """This step's work; admits waiting requests (mutating the cache) as they fit."""
        budget = self.max_num_tokens
        todo = [req.num_uncomputed for req in self.running]
        counts = [0] * len(todo)
        for i, n in enumerate(todo):  # decodes first
            if n == 1 and budget:
                counts[i] = 1
                budget -= 1
        for i, n in enumerate(todo):  # then prefill chunks
            if n > 1:
                counts[i] = self._take(n, budget)
                budget -= counts[i]
        if self.windowed:
            budget += self._reserve_rows(counts)
            if self.running and not any(counts):  # no block for anyone's next tokens
                self.preempt(self.running[-1])
                return Schedule([], None)  # admit nothing: the freed blocks go to the others
        held: list[Request] = []  # siblings waiting for a leader's prefix, in order
        while self.waiting and budget and self._free_slots:
            req = self.waiting[0]
            plan = self.manager.plan_admission(req.tokens, req.scope,
                                               first_chunk=budget if self.chunked else None)
            cfg = self.manager.config
            if self.share_prefixes and leader_of(req, plan.num_full_blocks, self.running,
                                                 cfg.tokens_per_block,
                                                 cfg.reuse_alignment_blocks):
                held.append(self.waiting.popleft())
                continue
            if not plan.fits:
                break  # wait for running requests to free blocks
            if not self.chunked and len(req.tokens) - plan.num_cached_tokens > budget:
                break
            seq = self.manager.admit(req.rid, plan, req.priority)
            self.waiting.popleft()
            req.seq = seq
            req.num_computed = seq.num_cached_tokens
            if req.num_cached_tokens is None:
                req.num_cached_tokens = seq.num_cached_tokens
                req.kv_metrics = seq.metrics
            req.slot = self._free_slots.pop()
            self.table.assign(req.slot, seq.live_block_ids(), seq.num_released_blocks)
            req.table_len = len(seq.block_ids)
            req.table_version = seq.block_ids_version
            self.batch.add(req.slot, req.num_computed)
            self.running.append(req)
            todo.append(req.num_uncomputed)
            counts.append(self._take(todo[-1], budget))
            budget -= counts[-1]
        self.waiting.extendleft(reversed(held))  # they keep their place in the queue
        chunks = [Chunk(req, n, n == t)
                  for req, n, t in zip(self.running, counts, todo, strict=True) if n]
        return Schedule(chunks, None if counts.count(1) == len(counts) else counts)

    def _take(self, todo: int, budget: int) -> int:
        if self.chunked:
            return min(todo, budget)
        return todo if todo <= budget else 0

    def _reserve_rows(self, counts: list[int]) -> int:
        """Reserve the blocks of every running request's tokens this step, cutting its
        count to what the pool covers; returns the tokens cut (budget given back)."""
        cut = 0
        for i, req in enumerate(self.running):
            if counts[i]:
                covered = self.manager.reserve(req.rid, req.num_computed + counts[i])
                self.sync_table(req)
                got = covered - req.num_computed
                cut += counts[i] - got
                counts[i] = got
        return cut

    def recount_batch(self) -> None:
        """Set the batch's rows from the running requests: after a step whose forward
        failed, the batch counted tokens the requests never computed."""
        rows = []
        for req in self.running:
            assert req.slot is not None
            rows.append((req.slot, req.num_computed))
        self.batch.reset(rows)

    def sync_table(self, req: Request) -> None:
        """Bring `req`'s row of the block table up to date with its cache handle: blocks
        appended, blocks released at the front (sliding window), or (after a
        deduplicated commit) the whole row. Call it after every commit and append, before
        the next forward pass: a block the manager took back may be handed to another
        request and overwritten in that very pass."""
        seq, slot = req.seq, req.slot
        assert seq is not None and slot is not None
        if seq.block_ids_version != req.table_version:
            self.table.assign(slot, seq.live_block_ids(), seq.num_released_blocks)
            self.batch.rewrite(slot)  # its kept pages name the blocks given back
            req.table_len = len(seq.block_ids)
            req.table_version = seq.block_ids_version
            return
        released = seq.num_released_blocks - int(self.table.starts[slot])
        if released > 0:
            self.table.drop_front(slot, released)
            self.batch.release_front(slot)
        if len(seq.block_ids) > req.table_len:
            self.table.extend(slot, seq.live_block_ids(req.table_len))
            req.table_len = len(seq.block_ids)

    def release(self, req: Request) -> None:
        """Free `req`'s blocks (committed ones stay cached) and its slot."""
        assert req.slot is not None
        self.manager.free_sequence(req.rid)
        self.batch.remove(req.slot)
        self.table.release(req.slot)
        self._free_slots.append(req.slot)
        self.running.remove(req)
        req.seq, req.slot, req.table_len, req.table_version = None, None, 0, 0

    def preempt(self, req: Request) -> None:
        """Release `req` and queue it first, to be recomputed (reusing what survives)."""
        self.release(req)
        req.num_computed = 0
        req.state.clear()
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def remove(self, rid: int) -> Request | None:
        """Take request `rid` out wherever it is (releasing it if running)."""
        for req in self.running:
            if req.rid == rid:
                self.release(req)
                return req
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return req
        return None

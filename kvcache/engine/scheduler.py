"""Scheduler: a per-step token budget over admission with reuse and chunked prefill, and
what a step's results do to its requests.

Each step, running requests take the budget first (decodes before prefill chunks, in
admission order), then waiting requests are admitted in arrival order while a batch
slot, token budget and blocks remain. Admission is one walk of the cache: the manager
plans it (what the prompt reuses, what it needs, whether that fits) and the scheduler
admits that plan or, when it does not fit, leaves the request waiting; nothing is
half-admitted, the batch join included (`_join`: a request whose rows cannot be made
gives its admission back and waits first in the queue). After the forward,
`postprocess` commits what each chunk computed, appends the sampled tokens, releases
the requests that are done and preempts those that get no block for their next token.
A postprocess is never left half-done: one that raises part-way (an interrupt, a
failure the cache raised) keeps its place, stage by stage, and `finish_postprocess`
completes it from there (see `_Postprocess`).

The running requests are the rows of a PersistentBatch, in admission order, and own a
slot of the BlockTable: the scheduler tells the batch who joins and who leaves, and a
step's chunks come in row order. A row of the table (and of the batch) mirrors the
request's cache handle, and only the scheduler writes it: on admission, once a step
after the step's commit and append (`_sync`: blocks appended, released at the front,
or switched by a deduplicated commit), after a windowed `reserve`, and when the request
leaves. The table is not append-only because the cache changes blocks a row already
lists: a deduplicated commit switches a block to an equal cached one (the row is
written again) and a sliding window releases blocks at the front (they leave the
front of the row, and their pages the front of the batch row: release_front).

Under a sliding window the cache allocates prompt blocks chunk by chunk: admission gets
the blocks of the first chunk, and each later chunk reserves its own, computing fewer
tokens when the pool is short. A step in which no running request can get a block
preempts the last of them, so the others can go on.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvcache.attention.block_table import BlockTable
from kvcache.core.handle import SequenceHandle
from kvcache.core.manager import KvCacheManager
from kvcache.core.pool import OutOfBlocksError
from kvcache.engine.prefix_sharing import leader_of
from kvcache.engine.step_fault import StepFault
from kvcache.engine.step_records import Chunk, Sampled, Schedule

if TYPE_CHECKING:  # they need torch; the scheduler does not
    from kvcache.attention.persistent.batch import PersistentBatch
    from kvcache.engine.request import Request

log = logging.getLogger(__name__)


# A chunk's postprocess, stage by stage (each also a phase of the fault seam):
#   commit  -> sync                  a chunk that does not sample
#   commit  -> release               its request reached max_new_tokens
#   commit  -> append -> sync        it goes on
#                     -> preempt     no block for its next token
_Stage = Literal["commit", "append", "release", "preempt", "sync"]


@dataclass
class _Postprocess:
    """A step's postprocess in progress: `chunks[index]` is at `stage` (not yet carried
    out), `row` is the sampled row of the next chunk that samples, `finished` the
    requests released so far. A stage changes nothing until it has succeeded, and then
    moves the cursor on, so a postprocess that raised goes on from the stage that
    raised."""

    chunks: list[Chunk]
    sampled: Sampled
    index: int = 0
    stage: _Stage = "commit"
    row: int = 0
    finished: list[Request] = field(default_factory=list)

    def next_chunk(self) -> None:
        self.index += 1
        self.stage = "commit"


class Scheduler:
    """Owns the waiting queue, the running set, their batch slots, table rows and batch
    rows. Not thread-safe (the engine holds its lock). `step_fault` is the engine's
    fault-injection seam (kvcache/engine/step_fault.py; None: off)."""

    def __init__(self, manager: KvCacheManager, table: BlockTable,
                 batch: PersistentBatch, *, max_num_tokens: int, max_batch_size: int,
                 chunked: bool, share_prefixes: bool = True) -> None:
        self.manager = manager
        self.table = table
        self.batch = batch
        self.windowed = manager.state.config.sliding_window is not None
        self.max_num_tokens = max_num_tokens
        self.chunked = chunked
        # hold siblings back until a running request commits their common prefix
        self.share_prefixes = share_prefixes and manager.state.reuse
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_batch_size - 1, -1, -1))
        # the handle's block_ids_version each slot's table row was last written at
        self._row_versions = [0] * max_batch_size
        self.step_fault: StepFault | None = None
        self._postprocess: _Postprocess | None = None  # a step's, until it is complete

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ before the step
    def schedule(self) -> Schedule:
        """This step's work; admits waiting requests (mutating the cache, the table and
        the batch) as they fit. Under a sliding window a step in which no running request
        gets a block for its tokens preempts the last one and schedules nothing. If it
        raises, what it admitted before stays admitted (each admission is all or
        nothing, `_join`) and the next call schedules again."""
        assert self._postprocess is None, "the last step's postprocess is not complete"
        if self.step_fault is not None:
            self.step_fault("schedule")
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
                if self.step_fault is not None:
                    self.step_fault("preempt")
                self.preempt(self.running[-1])
                return Schedule([], None)  # admit nothing: the freed blocks go to the others
        self._admit_waiting(budget, todo, counts)
        chunks = [Chunk(req, n, n == t)
                  for req, n, t in zip(self.running, counts, todo, strict=True) if n]
        return Schedule(chunks, None if counts.count(1) == len(counts) else counts)

    def _admit_waiting(self, budget: int, todo: list[int], counts: list[int]) -> None:
        """Admit waiting requests in order while a slot, budget and blocks remain, each
        taking its first chunk of `budget` (appended to `todo` and `counts`)."""
        held: list[Request] = []  # siblings waiting for a leader's prefix, in order
        cfg = self.manager.state.config
        try:
            while self.waiting and budget and self._free_slots:
                req = self.waiting[0]
                plan = self.manager.plan_admission(req.tokens, req.scope,
                                                   first_chunk=budget if self.chunked else None)
                if self.share_prefixes and leader_of(req, plan.num_full_blocks, self.running,
                                                     cfg.tokens_per_block,
                                                     cfg.reuse_alignment_blocks):
                    held.append(self.waiting.popleft())
                    continue
                if not plan.fits:
                    break  # wait for running requests to free blocks
                if not self.chunked and len(req.tokens) - plan.num_cached_tokens > budget:
                    break
                if self.step_fault is not None:
                    self.step_fault("admit")
                self._join(req, self.manager.admit(req.request_id, plan, req.priority))
                self.waiting.popleft()
                todo.append(req.num_uncomputed)
                counts.append(self._take(todo[-1], budget))
                budget -= counts[-1]
        finally:  # also when an admission raised: nobody leaves the queue unadmitted
            self.waiting.extendleft(reversed(held))  # they keep their place in the queue

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
                covered = self.manager.reserve(req.request_id, req.num_computed + counts[i])
                self._sync(req)
                got = covered - req.num_computed
                cut += counts[i] - got
                counts[i] = got
        return cut

    # ------------------------------------------------------------------ after the step
    def postprocess(self, chunks: list[Chunk], sampled: Sampled) -> list[Request]:
        """The step's forward ran: commit what each chunk computed, append the sampled
        tokens (and their logits, for requests that return them), release the requests
        that reached max_new_tokens and preempt those that get no block for their next
        token; the others' table and batch rows follow their handles. Returns the
        finished requests, in chunk order. Mutates the requests, the cache, the table
        and the batch.

        Never left half-done: if it raises part-way (an interrupt, an error the cache
        raised), the stage that raised changed nothing and the postprocess stays in
        progress; `finish_postprocess` completes it from that stage, and nothing else
        may use the scheduler until it did (the engine calls it first in every call)."""
        assert self._postprocess is None, "the last step's postprocess is not complete"
        self._postprocess = _Postprocess(chunks, sampled)
        return self.finish_postprocess()

    def finish_postprocess(self) -> list[Request]:
        """Complete the postprocess in progress, if one raised part-way, from the stage
        that raised; returns the requests it finished, in chunk order (those finished
        before it raised included; none when no postprocess is in progress). Raises
        what a stage raises (the postprocess then stays in progress)."""
        p = self._postprocess
        if p is None:
            return []
        while p.index < len(p.chunks):
            self._advance(p)
        self._postprocess = None
        return p.finished

    def _advance(self, p: _Postprocess) -> None:
        """Carry out the stages of `p`'s chunk from the one it is at, moving `p` on after
        each; a stage that raises changed nothing (its one fallible call, to the cache,
        changes nothing when it raises; what follows it are assignments)."""
        c = p.chunks[p.index]
        req, fault = c.req, self.step_fault
        while True:
            stage = p.stage
            if fault is not None:
                fault(stage)
            if stage == "commit":
                logits = None  # the row's own tensor, not a view keeping the batch's alive
                if c.samples and req.return_logits:
                    assert p.sampled.logits is not None, "a request returning logits sampled"
                    logits = p.sampled.logits[p.row].clone()
                num_computed = req.num_computed + c.num_new
                self.manager.commit(req.request_id, num_computed)
                req.num_computed = num_computed
                if not c.samples:
                    p.stage = "sync"
                    continue
                token = p.sampled.tokens[p.row]
                p.row += 1
                req.generated.append(token)
                req.tokens.append(token)
                if logits is not None:
                    req.logits.append(logits)
                p.stage = "release" if len(req.generated) >= req.max_new_tokens else "append"
            elif stage == "append":
                try:
                    self.manager.append_tokens(req.request_id, [req.generated[-1]])
                except OutOfBlocksError:
                    log.info("preempting request %d: no block for its next token",
                             req.request_id)
                    p.stage = "preempt"
                    continue
                p.stage = "sync"
            else:
                if stage == "release":
                    self.release(req)
                    p.finished.append(req)
                elif stage == "preempt":
                    self.preempt(req)
                else:
                    self._sync(req)
                p.next_chunk()
                return

    def recount_batch(self) -> None:
        """Set the batch's rows from the running requests: after a step that raised
        before it happened (its ops, forward or sampling), the batch counted tokens the
        requests never computed."""
        rows = []
        for req in self.running:
            assert req.slot is not None
            rows.append((req.slot, req.num_computed))
        self.batch.reset(rows)

    # ------------------------------------------------------------------ rows
    def _join(self, req: Request, seq: SequenceHandle) -> None:
        """The request the cache just admitted (`seq`, its handle) joins the batch: a
        slot, its table row and its batch row, and it runs. All or nothing: if a row
        cannot be made (an interrupt included), the rows made are taken back and the
        admission is given back to the cache (`free_sequence`: what it reused stays
        cached, a copy it queued is dropped), `req` is left as it was and the error
        propagates; the caller has not taken it off the waiting queue yet."""
        slot = self._free_slots[-1]
        try:
            if self.step_fault is not None:
                self.step_fault("join")
            self.table.assign(slot, seq.live_block_ids(), seq.num_released_blocks)
            self.batch.add(slot, seq.num_cached_tokens)
        except BaseException:
            self.table.release(slot)
            self.manager.free_sequence(req.request_id)
            raise
        # assignments only from here: the request joined
        self._free_slots.pop()
        self._row_versions[slot] = seq.block_ids_version
        req.seq, req.slot = seq, slot
        req.num_computed = seq.num_cached_tokens
        if req.num_cached_tokens is None:  # its first admission
            req.num_cached_tokens = seq.num_cached_tokens
            req.kv_metrics = seq.metrics
        self.running.append(req)

    def _sync(self, req: Request) -> None:
        """Bring `req`'s table row up to date with its cache handle, and its batch row
        with the table: blocks appended, blocks released at the front (sliding window),
        or, after a deduplicated commit, the whole row. Due after the step's commit and
        append and after a reserve, before the next forward pass: a block the manager
        took back may be handed to another request and overwritten in that very pass."""
        seq, slot, table = req.seq, req.slot, self.table
        assert seq is not None and slot is not None
        if seq.block_ids_version != self._row_versions[slot]:
            table.assign(slot, seq.live_block_ids(), seq.num_released_blocks)
            self._row_versions[slot] = seq.block_ids_version
            self.batch.rewrite(slot)  # its kept pages name the blocks given back
            return
        start = 0
        if self.windowed:  # under full attention no block is released
            start = int(table.starts[slot])
            released = seq.num_released_blocks - start
            if released > 0:
                table.drop_front(slot, released)
                self.batch.release_front(slot)
                start += released
        listed = start + int(table.lengths[slot])  # block positions the row covers
        if len(seq.block_ids) > listed:
            table.extend(slot, seq.live_block_ids(listed))

    def release(self, req: Request) -> None:
        """Free `req`'s blocks (committed ones stay cached), its slot and its rows."""
        slot = req.slot
        assert slot is not None
        self.manager.free_sequence(req.request_id)
        self.batch.remove(slot)
        self.table.release(slot)
        self._free_slots.append(slot)
        self.running.remove(req)
        req.seq, req.slot = None, None

    def preempt(self, req: Request) -> None:
        """Release `req` and queue it first, to be recomputed (reusing what survives)."""
        self.release(req)
        req.num_computed = 0
        req.state.clear()
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def remove(self, request_id: int) -> Request | None:
        """Take request `request_id` out wherever it is (releasing it if running); None
        when it is neither waiting nor running. If it raises, nothing changed."""
        assert self._postprocess is None, "the last step's postprocess is not complete"
        if self.step_fault is not None:
            self.step_fault("abort")
        for req in self.running:
            if req.request_id == request_id:
                self.release(req)
                return req
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return req
        return None

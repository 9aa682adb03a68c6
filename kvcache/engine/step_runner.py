"""StepRunner: one engine step, from the schedule to the commit.

    chunks = schedule()            admit with reuse, chunk prefills under the token budget
    apply the manager's ops        block copies, offloads, onboards, in queue order; those
                                   applied are acknowledged (leave the queue)
    restore snapshots              hybrid models: the recurrent state at the reuse boundary
    metadata                       from the persistent batch (kept across steps)
    plan + forward                 the backend plans once; each layer appends and attends
                                   (a failure up to here: the step did not happen, see run)
    keep recurrent states          hybrid models: the requests' states after the step
    save snapshots, sample, commit greedy (or forced) tokens; finished requests released,
                                   those without a block for their next token preempted

The Engine owns the parts (it builds them from its options) and the request-level API
around this: queueing, aborts, generate(), the lock. The runner is not thread-safe; the
engine calls it under its lock.
"""

from __future__ import annotations

import logging

import torch

from kvcache.attention.base import AttentionBackend
from kvcache.attention.persistent.batch import PersistentBatch
from kvcache.core.manager import KVCacheManager
from kvcache.core.pool import OutOfBlocksError
from kvcache.engine.cuda_graphs import DecodeGraphs
from kvcache.engine.request import FinishReason, GenerationOutput
from kvcache.engine.scheduler import Chunk, Scheduler
from kvcache.engine.state_snapshots import StateSnapshots
from kvcache.engine.step_context import StepContext, sampled_rows
from kvcache.engine.step_timer import StepTimer
from kvcache.model.transformer import Transformer
from kvcache.storage.kv_storage import KvStorage

log = logging.getLogger(__name__)


class StepRunner:
    """Runs steps over the engine's parts; counts steps and computed tokens.

    `batch` gives every step's metadata. `graphs` is None without CUDA graphs;
    `graph_batch_sizes` (empty: no padding) are the decode batch sizes a step pads to.
    `snapshots` is None unless a hybrid model reuses blocks.
    """

    def __init__(self, *, model: Transformer, backend: AttentionBackend,
                 manager: KVCacheManager, scheduler: Scheduler, storage: KvStorage,
                 batch: PersistentBatch, graphs: DecodeGraphs | None,
                 graph_batch_sizes: tuple[int, ...], snapshots: StateSnapshots | None,
                 device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.manager = manager
        self.scheduler = scheduler
        self.storage = storage
        self.batch = batch
        self.graphs = graphs
        self.graph_batch_sizes = graph_batch_sizes
        self.snapshots = snapshots
        self.device = device
        self.block_size = manager.config.tokens_per_block
        mc = model.config
        self._attn_layer = {layer: i for i, layer in enumerate(mc.attention_layers)}
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens the model ran on (padding excluded)
        self.timer: StepTimer | None = None

    def run(self) -> list[GenerationOutput] | None:
        """One step; returns the requests that finished in it, or None when nothing was
        scheduled (waiting requests wait for blocks, slots or budget).

        If applying the manager's ops or the forward raises (CUDA out of memory, an
        interrupt), the step did not happen and the error propagates: the ops not applied
        stay queued, in order (those applied left the queue), the batch is recounted,
        every request keeps the recurrent state, tokens and counts it had, and so does
        the runner; the next call schedules the same work (with whatever arrived
        meanwhile) and runs it again. What the schedule admitted stays admitted.
        """
        timer = self.timer
        if timer is not None:
            timer.start()
        chunks, row_tokens = self.scheduler.schedule()
        if not chunks:
            return None
        try:
            # copies, offloads and onboards, in queue order, before the forward writes or
            # reads any block they touch (an evicted block's new owner writes it this
            # step). Only the ops applied leave the queue: a failed apply is retried from
            # the first op it did not apply, and an applied op never runs twice.
            ops = self.manager.pending_copy_ops
            if ops:
                try:
                    self.storage.apply_copies(ops)
                finally:
                    self.manager.ack_copy_ops(self.storage.num_applied)
            if self.snapshots is not None:
                self.snapshots.restore(chunks, self.block_size)
            if timer is not None:
                timer.lap("schedule")
            logits, ctx = self._forward(chunks, row_tokens)
        except BaseException:
            self.scheduler.recount_batch()
            raise
        ctx.commit_states()  # the recurrent layers' states, kept aside until now
        if self.snapshots is not None:
            for block, states in ctx.snapshot_states.items():
                self.snapshots.save(block, states)  # before the commit makes it matchable
        self.num_steps += 1
        tokens = self._sample(chunks, logits)
        if timer is not None:
            timer.lap("sample")
        finished = self._commit(chunks, tokens)
        if timer is not None:
            timer.lap("commit")
            timer.finish()
        return finished

    def _forward(self, chunks: list[Chunk], row_tokens: list[int] | None
                 ) -> tuple[torch.Tensor, StepContext]:
        """Logits of the sampling rows, and the step's context: the recurrent layers'
        states after the step (not yet the requests') and the snapshots taken (block id
        -> state per recurrent layer). row_tokens: the schedule's, for the batch."""
        timer = self.timer
        pad_to = None
        sizes = self.graph_batch_sizes
        if sizes and len(chunks) <= sizes[-1] and all(c.num_new == 1 and c.samples
                                                       for c in chunks):
            pad_to = next(s for s in sizes if s >= len(chunks))
        # The batch's metadata views its buffers: valid until the next step changes them.
        md = self.batch.step(row_tokens, pad_to=pad_to)
        ids: list[int] = []
        for c in chunks:
            req = c.req
            ids += req.tokens[req.num_computed:req.num_computed + c.num_new]
        num_tokens = len(ids)
        ids += [0] * md.num_padded
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = md.positions.to(self.device)
        rows = sampled_rows(chunks, self.device)  # one selection for the eager and graph paths
        snapshot_rows = (self.snapshots.rows(chunks, self.block_size)
                         if self.snapshots is not None else None)
        ctx = StepContext(self.backend, self._attn_layer, md, [c.req for c in chunks],
                          self.model.config.hidden_size, self.device, snapshot_rows)
        if timer is not None:
            timer.lap("metadata")
        with torch.inference_mode():
            if self.graphs is not None and md.is_decode and md.batch_size in self.graphs.sizes:
                logits = self.graphs.run(md, input_ids, positions, ctx).index_select(0, rows)
            else:
                self.backend.plan(md)
                if timer is not None:
                    timer.lap("plan")
                logits = self.model(input_ids, positions, ctx, rows)
        if timer is not None:
            timer.lap("forward")
        self.num_computed_tokens += num_tokens  # counted once the forward succeeded
        return logits, ctx

    def _sample(self, chunks: list[Chunk], logits: torch.Tensor) -> list[int]:
        """The next token of every chunk that samples, in order (greedy, or forced); keeps
        the logits of requests that return them. One argmax for the batch: per row it
        cost ~5 us a request."""
        greedy = logits.argmax(-1).tolist()
        host = None
        tokens = []
        for row, req in enumerate(c.req for c in chunks if c.samples):
            tokens.append(req.forced[len(req.generated)] if req.forced is not None
                          else greedy[row])
            if req.return_logits:
                if host is None:
                    host = logits.detach().to("cpu", torch.float32)
                req.logits.append(host[row].clone())
        return tokens

    def _commit(self, chunks: list[Chunk], tokens: list[int]) -> list[GenerationOutput]:
        """Commit what the step computed, append the sampled tokens, release finished
        requests and preempt those that get no block for their next token."""
        finished = []
        sampled = iter(tokens)
        for c in chunks:
            req = c.req
            req.num_computed += c.num_new
            self.manager.commit(req.rid, req.num_computed)
            # a deduplicated commit switches blocks (the snapshots of those it gives back
            # go through the manager's on_blocks_removed), a window releases some
            self.scheduler.sync_table(req)
            if not c.samples:
                continue
            tok = next(sampled)
            req.generated.append(tok)
            req.tokens.append(tok)
            if len(req.generated) >= req.max_new_tokens:
                self.scheduler.release(req)
                finished.append(req.output(FinishReason.LENGTH))
                continue
            try:
                self.manager.append_tokens(req.rid, [tok])
            except OutOfBlocksError:
                log.info("preempting request %d: no block for its next token", req.rid)
                self.scheduler.preempt(req)
                continue
            self.scheduler.sync_table(req)
        return finished

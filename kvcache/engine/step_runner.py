"""StepRunner: one forward pass of the model over a step's schedule, and its sampling.

    start states          hybrid models: each request's recurrent state, or for a warm
                          one the snapshot at its reuse boundary
    metadata              from the persistent batch (kept across steps), input ids,
                          positions, the step context
    plan + forward        the backend plans once; each layer appends and attends (a
                          CUDA-graph decode step plans and replays its captured graph)
    snapshots             hybrid models: the states at the blocks due for a snapshot
    sample                greedy (or forced) tokens, and the logits to keep
    keep                  (once `run` returned) the requests take their new recurrent
                          states, the snapshots are saved, the counters move

`run` computes the step and changes nothing but the batch's counts: if it raises,
anywhere up to and including sampling (where a deferred CUDA error surfaces, and where
an interrupt may land), `Scheduler.recount_batch` puts the counts right and the step did
not happen: no request took a state, no snapshot was saved, no counter moved. `keep`
makes the step happen; it only assigns what `run` computed, so it cannot fail. The
block copies before it are the engine's, and what the sampled tokens do to the requests
and the cache is the scheduler's `postprocess`. Not thread-safe; the engine calls it
under its lock.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcache.attention.base import AttentionBackend
from kvcache.attention.persistent.batch import PersistentBatch
from kvcache.engine.cuda_graphs import DecodeGraphs
from kvcache.engine.state_snapshots import StateSnapshots
from kvcache.engine.step_context import StepContext, sampled_rows
from kvcache.engine.step_fault import StepFault
from kvcache.engine.step_records import Chunk, Sampled, Schedule
from kvcache.engine.step_timer import StepTimer
from kvcache.model.transformer import Transformer


class StepResult(NamedTuple):
    """A step computed and not yet kept (`StepRunner.keep`): what it `sampled`, its
    `context` (the recurrent layers' new states), the `snapshots` it took (block id ->
    [recurrent layers, hidden] float32) and the tokens the model ran on (`num_tokens`,
    padding excluded)."""

    sampled: Sampled
    context: StepContext
    snapshots: dict[int, torch.Tensor]
    num_tokens: int


class StepRunner:
    """Runs the model over scheduled steps; counts steps and computed tokens.

    `batch` gives every step's metadata. `graphs` is None without CUDA graphs;
    `pad_sizes` (empty: no padding) are the decode batch sizes a step pads to.
    `snapshots` is None unless a hybrid model reuses blocks. `step_fault` is the engine's
    fault-injection seam (kvcache/engine/step_fault.py; None: off).
    """

    def __init__(self, model: Transformer, backend: AttentionBackend, batch: PersistentBatch,
                 *, graphs: DecodeGraphs | None, pad_sizes: tuple[int, ...],
                 snapshots: StateSnapshots | None, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.batch = batch
        self.graphs = graphs
        self.pad_sizes = pad_sizes
        self.snapshots = snapshots
        self.block_size = block_size
        self.device = device
        self.step_fault: StepFault | None = None
        self._attn_layer = {layer: i for i, layer in enumerate(model.config.attention_layers)}
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens the model ran on (padding excluded)

    def run(self, schedule: Schedule, timer: StepTimer | None = None) -> StepResult:
        """Run the model over `schedule` (chunks in batch-row order) and sample; laps
        `timer`'s metadata, plan, forward and sample phases. Mutates only the batch's
        counts; `keep` the result to make the step happen. Raises what the metadata, the
        plan, the forward or sampling raises (out of memory, an interrupt): then only the
        batch's counts must be recounted."""
        chunks = schedule.chunks
        start = (self.snapshots.start_states(chunks, self.block_size)
                 if self.snapshots is not None else [c.req.state for c in chunks])
        logits, ctx, num_tokens = self._forward(chunks, schedule.row_tokens, start, timer)
        snapshots = ctx.snapshots()
        if self.step_fault is not None:
            self.step_fault("sample")
        sampled = self._sample(chunks, logits)
        if timer is not None:
            timer.lap("sample")
        return StepResult(sampled, ctx, snapshots, num_tokens)

    def keep(self, result: StepResult) -> None:
        """The step happened: its requests take their new recurrent states, its snapshots
        are saved (before the postprocess's commit makes their blocks matchable) and the
        step and its tokens are counted. Assignments only: it cannot fail."""
        result.context.commit_states()
        if self.snapshots is not None:
            for block, snapshot in result.snapshots.items():
                self.snapshots.save(block, snapshot)
        self.num_steps += 1
        self.num_computed_tokens += result.num_tokens

    def _forward(self, chunks: list[Chunk], row_tokens: list[int] | None,
                 start_states: list[dict[int, torch.Tensor]],
                 timer: StepTimer | None) -> tuple[torch.Tensor, StepContext, int]:
        """Logits of the sampling rows, the step's context (the recurrent layers' states
        after the step, not yet the requests', and the snapshot states taken) and the
        tokens the model ran on. row_tokens: the schedule's, for the batch;
        start_states: each chunk's request's recurrent state before the step."""
        pad_to = None
        sizes = self.pad_sizes
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
                          start_states, self.model.config.hidden_size, self.device,
                          snapshot_rows, self.step_fault)
        if timer is not None:
            timer.lap("metadata")
        if self.step_fault is not None:
            self.step_fault("plan")
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
        return logits, ctx, num_tokens

    def _sample(self, chunks: list[Chunk], logits: torch.Tensor) -> Sampled:
        """The next token of every chunk that samples, in order (greedy, or forced), and
        the logits on the host when a sampling request returns them. One argmax for the
        batch, not one a request."""
        greedy = logits.argmax(-1).tolist()
        tokens = []
        keep = False
        for row, req in enumerate(c.req for c in chunks if c.samples):
            tokens.append(req.forced[len(req.generated)] if req.forced is not None
                          else greedy[row])
            keep = keep or req.return_logits
        return Sampled(tokens, logits.detach().to("cpu", torch.float32) if keep else None)

"""Engine: a small inference engine whose outputs prove that block reuse is correct.

    engine = Engine("tiny", KvCacheConfig(...), EngineConfig(attn_backend="torch"))
    engine = Engine("tiny", KvCacheConfig(...), attn_backend="torch")  # the same
    outs = engine.generate(prompts, max_new_tokens=8)

The Engine builds the parts from its options (kvcache/engine/config.py: model, cache
manager, KV storage, backend, block table, persistent batch, scheduler, CUDA graphs,
snapshots), runs the step (schedule, apply the cache's block ops, run the model, keep
what it computed, postprocess: `_step`; all or nothing wherever it is interrupted) and
is the thread-safe request API: add_request, abort, step, generate, each under one fair
lock (kvcache/engine/fair_lock.py). The scheduler owns the requests (their admission,
rows and what a step's tokens do to them: kvcache/engine/scheduler.py), the step runner
the forward pass and sampling (kvcache/engine/step_runner.py), and `Waiters` where a
finished request's output goes, to the generate() awaiting it or to the next step()
(kvcache/engine/waiters.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvcache.attention.base import AttentionBackend
from kvcache.attention.block_table import BlockTable
from kvcache.attention.layer_windows import backend_for_windows
from kvcache.attention.persistent.batch import PersistentBatch
from kvcache.core.config import KvCacheConfig
from kvcache.core.keys import ReuseScope
from kvcache.core.manager import DEFAULT_PRIORITY, KvCacheManager
from kvcache.core.stats import KvCacheStats
from kvcache.core.validate import check_positive_int, check_priority
from kvcache.core.window import peak_blocks
from kvcache.engine.config import EngineConfig, with_options
from kvcache.engine.cuda_graphs import DecodeGraphs
from kvcache.engine.fair_lock import FairLock
from kvcache.engine.request import (
    FinishReason,
    GenerationOutput,
    Request,
    RequestFinishedError,
    check_prompts,
    check_tokens,
)
from kvcache.engine.reuse_policy import resolve_reuse, resolve_window
from kvcache.engine.scheduler import Scheduler
from kvcache.engine.state_snapshots import StateSnapshots
from kvcache.engine.step_fault import StepFault
from kvcache.engine.step_runner import StepRunner
from kvcache.engine.step_timer import StepTimer
from kvcache.engine.waiters import Waiters
from kvcache.model.config import ModelConfig, get_preset
from kvcache.model.transformer import Transformer
from kvcache.storage.kv_storage import KvStorage

# Admission into an idle engine fails only transiently (all blocks are then free or
# evictable, and add_request rejects what could never fit); give up after this many.
MAX_IDLE_STEPS = 8


def _kv_storage(cache: KvCacheConfig, model: ModelConfig, config: EngineConfig,
                device: torch.device) -> KvStorage:
    """The engine's KV storage for `cache`'s pools: one storage layer per attention layer
    of `model` (at least one). Raises ValueError naming `KvCacheConfig.max_num_blocks`
    and `host_cache_blocks` and the bytes they ask for when torch cannot allocate it
    (out of memory: RuntimeError or MemoryError)."""
    num_layers, dtype = max(1, len(model.attention_layers)), config.dtype
    try:
        return KvStorage(num_layers=num_layers, num_blocks=cache.max_num_blocks,
                         block_size=cache.tokens_per_block, num_kv_heads=model.num_kv_heads,
                         head_dim=model.head_dim, dtype=dtype, device=device,
                         layout=config.layout, host_num_blocks=cache.host_cache_blocks)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        per_block = (2 * num_layers * cache.tokens_per_block * model.num_kv_heads
                     * model.head_dim * dtype.itemsize)
        host = (f" and KvCacheConfig.host_cache_blocks={cache.host_cache_blocks} host blocks "
                f"({cache.host_cache_blocks * per_block} bytes)" if cache.host_cache_blocks
                else "")
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"Engine: cannot allocate the KV storage on {device}: "
                         f"KvCacheConfig.max_num_blocks={cache.max_num_blocks} device blocks "
                         f"({cache.max_num_blocks * per_block} bytes){host}, {per_block} bytes "
                         f"a block; lower them (torch: {reason})") from e


def _attention_backend(model: ModelConfig, storage: KvStorage,
                       config: EngineConfig) -> AttentionBackend:
    """`config`'s backend over `storage`: storage layer i is model layer
    attention_layers[i]; with no attention layer the storage still has one (unused), at
    the model's window. A LayerWindows when the layers' windows differ."""
    options = dict(config.backend_options)
    if config.cuda_graph:
        options["graph_batch_sizes"] = config.graph_batch_sizes
    windows = [model.layer_window_left(i) for i in model.attention_layers] or [model.window_left]
    return backend_for_windows(config.backend_class, windows, storage=storage,
                               num_qo_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                               head_dim=model.head_dim, page_size=config.page_size, **options)


def _snapshots(model: ModelConfig, cache: KvCacheConfig, manager: KvCacheManager,
               interval: int) -> StateSnapshots | None:
    """The recurrent-state snapshots of a hybrid model that reuses blocks (None for any
    other), a listener of `manager`: they leave with their blocks, and follow them to
    the host tier and back."""
    if not (model.has_recurrent_layers and cache.block_reuse):
        return None
    snapshots = StateSnapshots(model.recurrent_layers, model.hidden_size, interval)
    manager.add_listener(snapshots)
    return snapshots


class Engine:
    """Greedy generation over a paged KV cache with block reuse.

    `model` is a Transformer or a preset name (weights from `engine_config.seed`);
    `cache_config` sizes the cache and sets its reuse policy; `engine_config` holds the
    engine's options (EngineConfig; None: the defaults), and keyword `options` replace
    its fields (`Engine("tiny", cfg, max_num_tokens=64)`). The effective cache config
    (`cache_config`, with reuse and the window resolved for this backend and model) and
    why reuse was switched off (`reuse_disabled_reason`) are attributes. For a model
    mixing windowed and full-attention layers `backend` is a LayerWindows, one member
    per window (`attn_backend` keeps the registered name).

    Raises ValueError naming the bad option, TypeError naming an option that is not an
    EngineConfig field, and ValueError for what this machine or model cannot run:
    cuda_graph without CUDA or with recurrent layers, a window or reuse the model or
    backend rules out (kvcache/engine/reuse_policy.py), a KV storage torch cannot
    allocate (naming the `KvCacheConfig` sizes and the bytes).

    Thread-safe: add_request, step, abort and generate take one fair lock (`FairLock`),
    so requests may arrive from other threads while one thread runs the step loop; such
    a call waits for at most the step in progress, never for the work to drain. Every
    public read is safe from any thread too: has_unfinished, kv_cache_stats and
    admission_log take the lock (a metrics thread polling them waits for at most one
    step, and reads no half-made step, but for one whose postprocess an error
    interrupted, until the next step() or abort() completes it); num_steps,
    num_computed_tokens, step_timer and idle read one value, without the lock. The
    parts (manager, scheduler, storage, ...) are not thread-safe: read them only from
    the thread that steps, or under the lock.
    """

    def __init__(self, model: Transformer | str, cache_config: KvCacheConfig,
                 engine_config: EngineConfig | None = None, **options: Any) -> None:
        config = self.config = with_options(engine_config, options, "Engine")
        if not isinstance(cache_config, KvCacheConfig):
            raise ValueError(f"Engine: cache_config must be a KvCacheConfig, got {cache_config!r}")
        if config.cuda_graph and not torch.cuda.is_available():
            raise ValueError("Engine: cuda_graph=True needs CUDA, but torch.cuda.is_available() "
                             "is False on this machine")
        self.device = torch.device(config.device)
        if isinstance(model, str):
            model = Transformer(get_preset(model), seed=config.seed)
        self.model = model.to(device=self.device, dtype=config.dtype).eval()
        model_config = model.config
        if config.cuda_graph and model_config.has_recurrent_layers:
            raise ValueError("Engine: cuda_graph=True is unsupported for models with "
                             "recurrent layers")
        backend_cls = config.backend_class
        windowed = resolve_window(cache_config, backend_cls, model, config.release_outside_window)
        self.cache_config, self.reuse_disabled_reason = resolve_reuse(
            windowed, backend_cls, model, config.state_snapshot_interval)
        block_size = cache_config.tokens_per_block
        self.manager = KvCacheManager(self.cache_config, record_events=config.record_events,
                                      kv_events=config.kv_events)
        self.snapshots = _snapshots(model_config, self.cache_config, self.manager,
                                    config.state_snapshot_interval)
        self.storage = _kv_storage(self.cache_config, model_config, config, self.device)
        self.attn_backend = backend_cls.name
        self.backend = _attention_backend(model_config, self.storage, config)
        self.max_model_len = model_config.max_position_embeddings
        pad_sizes = config.graph_batch_sizes if config.pads_decode else ()
        # A request never holds more blocks than the pool has (add_request rejects it), so
        # the table is sized by the pool, never by the model's maximum length alone.
        self.table = BlockTable(config.max_batch_size, min(-(-self.max_model_len // block_size),
                                                           cache_config.max_num_blocks))
        self.batch = PersistentBatch(self.table, block_size=block_size,
                                     page_size=self.backend.page_size,
                                     page_index_multiplier=self.backend.page_index_multiplier,
                                     max_padded=max(pad_sizes, default=None))
        self.scheduler = Scheduler(self.manager, self.table, self.batch,
                                   max_num_tokens=config.max_num_tokens,
                                   max_batch_size=config.max_batch_size,
                                   chunked=config.enable_chunked_prefill,
                                   share_prefixes=config.share_prefixes)
        self.graphs = (DecodeGraphs(self.model, self.backend, pad_sizes, self.device)
                       if config.cuda_graph else None)
        self.runner = StepRunner(self.model, self.backend, self.batch, graphs=self.graphs,
                                 pad_sizes=pad_sizes, snapshots=self.snapshots,
                                 block_size=block_size, device=self.device)
        self._lock = FairLock()
        self._timer: StepTimer | None = None
        self._next_request_id = 0
        self._waiters = Waiters()  # finished outputs, until their generate() or step()
        self.idle = False  # the last step scheduled nothing

    @classmethod
    def from_pretrained(cls, path: str | Path, cache_config: KvCacheConfig,
                        engine_config: EngineConfig | None = None, *,
                        check_finite: bool = True, **options: Any) -> Engine:
        """An engine over an HF-format checkpoint (config.json + *.safetensors): `path` is
        its folder or config.json; `check_finite=False` skips the NaN/inf scan of the
        weights; `engine_config` and `options` as for Engine() (the weights load in its
        dtype, on its device). Raises what `load_pretrained` raises (naming the file and
        what is wrong) and what Engine() raises."""
        from kvcache.model.checkpoint import load_pretrained

        config = with_options(engine_config, options, "Engine.from_pretrained")
        model = load_pretrained(path, dtype=config.dtype, device=config.device,
                                check_finite=check_finite)
        return cls(model, cache_config, config)

    @property
    def num_steps(self) -> int:
        """Steps that ran the model (a step that raised did not). Safe from any thread:
        one int, read without the lock."""
        return self.runner.num_steps

    @property
    def num_computed_tokens(self) -> int:
        """Tokens the model ran on (padding excluded; a step that raised ran none). Safe
        from any thread: one int, read without the lock."""
        return self.runner.num_computed_tokens

    @property
    def step_fault(self) -> StepFault | None:
        """The fault-injection seam (kvcache/engine/step_fault.py), for tests: called with
        a phase's name at each of the step's phase points, it fails the step there by
        raising. None (the default) calls nothing. Setting it takes the lock (it applies
        from the next call) and hands it to the parts that reach the points (scheduler,
        runner, storage)."""
        return self.scheduler.step_fault

    @step_fault.setter
    def step_fault(self, fault: StepFault | None) -> None:
        with self._lock:
            self.scheduler.step_fault = self.runner.step_fault = fault
            self.storage.step_fault = fault

    @property
    def step_timer(self) -> StepTimer | None:
        """Times every step's phases when set (None: untimed). Read from any thread
        without the lock; setting it takes the lock (it applies from the next step)."""
        return self._timer

    @step_timer.setter
    def step_timer(self, timer: StepTimer | None) -> None:
        with self._lock:
            self._timer = timer

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], max_new_tokens: int,
                    scope: ReuseScope | None = None, *, priority: int = DEFAULT_PRIORITY,
                    force_tokens: Sequence[int] | None = None,
                    return_logits: bool = True) -> int:
        """Queue a request; returns its id. `force_tokens` replaces greedy sampling
        (teacher forcing). Raises ValueError naming the bad value for bad input or a
        request that could never fit the model, the pool or (unchunked) the budget."""
        with self._lock:
            request_id = self._next_request_id
            where = f"add_request(#{request_id})"
            vocab = self.model.config.vocab_size
            tokens = check_tokens(prompt, vocab, f"{where}: prompt")
            if not tokens:
                raise ValueError(f"{where}: empty prompt")
            max_new_tokens = check_positive_int(max_new_tokens, f"{where}: max_new_tokens")
            self._check_fits(len(tokens), len(tokens) + max_new_tokens, where)
            forced = None
            if force_tokens is not None:
                forced = check_tokens(force_tokens, vocab, f"{where}: force_tokens")
                if len(forced) < max_new_tokens:
                    raise ValueError(f"{where}: force_tokens has {len(forced)} tokens, "
                                     f"max_new_tokens is {max_new_tokens}")
            if scope is not None and not isinstance(scope, ReuseScope):
                raise ValueError(f"{where}: scope must be None or ReuseScope, got {scope!r}")
            priority = check_priority(priority, where)
            self._next_request_id += 1
            self.scheduler.waiting.append(Request(request_id, tokens, max_new_tokens, scope,
                                                  priority, forced, return_logits))
            return request_id

    def _check_fits(self, prompt_len: int, total: int, where: str) -> None:
        """Raise ValueError (naming `where`) for a request of `total` tokens that could
        never run: past the model's length, more blocks than the pool, or (unchunked)
        more tokens than one step's budget."""
        if total > self.max_model_len:
            raise ValueError(f"{where}: prompt of {prompt_len} tokens + {total - prompt_len} "
                             f"new exceeds the model's maximum of {self.max_model_len}")
        blocks = self._blocks_needed(prompt_len, total)
        if blocks > self.cache_config.max_num_blocks:
            raise ValueError(f"{where}: needs {blocks} blocks, the pool has only "
                             f"{self.cache_config.max_num_blocks}: it can never fit")
        budget = self.config.max_num_tokens
        if not self.config.enable_chunked_prefill and total > budget:
            raise ValueError(f"{where}: {total} tokens exceed max_num_tokens={budget} "
                             "without chunked prefill")

    def _blocks_needed(self, prompt_len: int, total: int) -> int:
        """The most blocks a request holds at once: all of them under full attention;
        under a sliding window its window and one step's chunk (kvcache/core/window.py)."""
        cache = self.cache_config
        block_size = cache.tokens_per_block
        if cache.sliding_window is None:
            return -(-total // block_size)
        chunk = self.config.max_num_tokens if self.config.enable_chunked_prefill else prompt_len
        return peak_blocks(prompt_len, total, chunk, cache.sliding_window - 1, block_size,
                           cache.block_reuse)

    def abort(self, request_id: int) -> GenerationOutput:
        """Cancel request `request_id`; its blocks are released, what it committed stays
        cached.

        Returns its partial output (finish reason ABORTED); a generate() call waiting for
        the request returns the same output in its place. Raises RequestFinishedError (a
        ValueError) if the request already finished or was aborted, and ValueError for
        an id this engine never issued (changing nothing). A postprocess an error
        interrupted is completed first (see `step`): a request that finished in it
        raises RequestFinishedError, its output waiting for the next step() (or its
        generate()). An abort that raises otherwise (an interrupt) changed nothing.
        """
        with self._lock:
            issued = self._next_request_id
            if isinstance(request_id, bool) or not isinstance(request_id, int | np.integer) \
                    or not 0 <= request_id < issued:
                which = (f"ids 0 to {issued - 1} were issued" if issued
                         else "no request was added yet")
                raise ValueError(f"abort({request_id!r}): no such request; {which}")
            self._settle()
            req = self.scheduler.remove(int(request_id))
            if req is None:
                raise RequestFinishedError(f"abort(#{request_id}): request #{request_id} "
                                           "already finished or was aborted; nothing to abort")
            out = req.output(FinishReason.ABORTED)
            self._waiters.claim([out])  # a generate() awaiting it returns it too
            return out

    def has_unfinished(self) -> bool:
        """True while any request waits or runs (those of a postprocess an error
        interrupted included, until the next step() completes it and returns them).
        Takes the lock (safe from any thread: a request moving from waiting to running
        is never missed)."""
        with self._lock:
            return len(self.scheduler) > 0

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[GenerationOutput]:
        """Run one step; returns the requests that finished in it, and any that finished
        earlier inside some generate() call that was not waiting for them.

        A step is all or nothing, wherever an error (CUDA out of memory, an interrupt)
        strikes it. Up to and including sampling it did not happen: the error
        propagates, every request keeps what it had (KV, recurrent state, tokens,
        counts), the copies not applied stay queued, and the next step() runs the same
        work again. Once it sampled it happened: if its postprocess raises part-way,
        the next call completes it before anything else (see `_step`)."""
        with self._lock:
            self._waiters.hold(self._step())
            return self._waiters.take_held()

    def _step(self) -> list[GenerationOutput]:
        """One step: schedule, apply the cache's block ops, run the model, postprocess.
        Returns the requests that finished in it (none when nothing was scheduled: then
        `idle` is set).

        First it completes the postprocess of a step that raised in it (`_settle`).
        If scheduling raises, what it admitted stays admitted (each admission, batch
        join included, is all or nothing). If applying the ops, the forward or sampling
        raises, the step did not happen and the error propagates: the ops not applied
        stay queued (those applied left the queue), the batch is recounted, every
        request keeps the recurrent state, tokens and counts it had and no counter
        moved; the next call schedules the same work (with whatever arrived meanwhile).
        Then the step happens (`StepRunner.keep`: states, snapshots, counters; it
        cannot fail) and its postprocess runs; if that raises part-way, it stays in
        progress and the engine's next call completes it from where it stopped."""
        self._settle()
        timer = self._timer
        if timer is not None:
            timer.start()
        schedule = self.scheduler.schedule()
        self.idle = not schedule.chunks
        if self.idle:
            return []
        try:
            self._apply_ops()
            if timer is not None:
                timer.lap("schedule")
            result = self.runner.run(schedule, timer)
        except BaseException:
            self.scheduler.recount_batch()  # the batch counted tokens never computed
            raise
        self.runner.keep(result)
        finished = self.scheduler.postprocess(schedule.chunks, result.sampled)
        if timer is not None:
            timer.lap("commit")
            timer.finish()
        return [req.output(FinishReason.LENGTH) for req in finished]

    def _settle(self) -> None:
        """Complete the postprocess of a step that raised in it, if one did: the
        requests it finishes go to the generate() awaiting them or to the next step().
        Called first, under the lock, by every call that changes the requests (step,
        abort, a failed generate's clean-up), so none works on a half-done step. Raises
        what the postprocess raises (it then stays in progress)."""
        finished = self.scheduler.finish_postprocess()
        if finished:
            self._waiters.hold([req.output(FinishReason.LENGTH) for req in finished])

    def _apply_ops(self) -> None:
        """Apply the cache's copies, offloads and onboards to the storage, in queue order,
        before the forward writes or reads any block they touch (an evicted block's new
        owner writes it this step). Only the ops applied leave the queue: a failed apply
        is retried from the first op it did not apply, and an applied op never runs
        twice. Raises what the storage raises."""
        ops = self.manager.pending_copy_ops
        if ops:
            try:
                self.storage.apply_copies(ops)
            finally:
                self.manager.ack_copy_ops(self.storage.num_applied)

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8,
                 scopes: Sequence[ReuseScope | None] | None = None, *,
                 return_logits: bool = True,
                 force_tokens: Sequence[Sequence[int]] | None = None) -> list[GenerationOutput]:
        """Run `prompts` (a list of token lists) to completion; outputs in prompt order.

        A request another thread aborts meanwhile is returned as aborted (its partial
        output, finish reason ABORTED). Raises ValueError naming the bad value for bad
        input (nothing is queued then), RuntimeError if its requests stay unadmittable.
        Whatever a step raises (a forward or a copy that failed, an interrupt)
        propagates, after the call completed a postprocess the error interrupted and
        aborted every request it added that is still queued or running: their blocks are
        freed (what they committed stays cached), none is left to come out of another
        caller's step(), and the engine stays usable (a step is all or nothing; see
        `step`).
        """
        check_prompts(prompts)
        if scopes is not None and len(scopes) != len(prompts):
            raise ValueError(f"generate: {len(scopes)} scopes for {len(prompts)} prompts")
        if force_tokens is not None and len(force_tokens) != len(prompts):
            raise ValueError(f"generate: {len(force_tokens)} force_tokens for "
                             f"{len(prompts)} prompts")
        request_ids: list[int] = []
        with self._lock:
            try:
                for i, p in enumerate(prompts):
                    request_ids.append(self.add_request(
                        p, max_new_tokens, scopes[i] if scopes else None,
                        force_tokens=force_tokens[i] if force_tokens else None,
                        return_logits=return_logits))
            except ValueError:
                for request_id in request_ids:  # all or nothing: no orphans left queued
                    self.scheduler.remove(request_id)
                if request_ids:  # under the lock, so the ids were consecutive
                    self._next_request_id = request_ids[0]
                raise
            self._waiters.expect(request_ids)
        try:
            return self._wait_for(request_ids)
        except BaseException:
            with self._lock:
                self._settle()
                for request_id in request_ids:  # no output yet: still queued or running
                    if not self._waiters.has_output(request_id):
                        self.scheduler.remove(request_id)
            raise
        finally:
            with self._lock:
                self._waiters.forget(request_ids)

    def _wait_for(self, request_ids: list[int]) -> list[GenerationOutput]:
        """Step until every one of `request_ids` has an output (in that order); others'
        outputs wait for the next step(). Raises RuntimeError when nothing runs and
        they stay unadmitted for more than MAX_IDLE_STEPS steps."""
        stalls = 0
        while True:
            with self._lock:
                outputs = self._waiters.ready(request_ids)
                if outputs is not None:
                    return outputs
                self._waiters.hold(self._step())
                stalls = stalls + 1 if self.idle and not self.scheduler.running else 0
                if stalls > MAX_IDLE_STEPS:
                    # Aborted requests have outputs by now: what is left is still waiting
                    # (generate removes it).
                    stalled = [r.request_id for r in self.scheduler.waiting
                               if r.request_id in request_ids]
                    raise RuntimeError(f"generate: no progress in {stalls} steps with nothing "
                                       f"running; {len(stalled)} of its requests could not "
                                       f"be admitted (allocation kept failing): {stalled}")

    def kv_cache_stats(self) -> KvCacheStats:
        """The manager's cumulative statistics, with the recurrent-state snapshots' memory.
        Takes the lock: safe from any thread (a metrics poller waits for at most the step
        in progress, and sees the cache between steps)."""
        with self._lock:
            stats = self.manager.stats()
            if self.snapshots is None:
                return stats
            return replace(stats, state_snapshot_bytes=self.snapshots.nbytes)

    def admission_log(self) -> list[dict[str, Any]]:
        """Every cache operation in the order the cache saw it (for the reuse oracle), as
        plain dicts (a copy). Takes the lock: safe from any thread. Raises ValueError
        for an engine built with record_events=False."""
        events = self.manager.state.events
        if events is None:
            raise ValueError("admission_log: the engine was built with record_events=False")
        with self._lock:
            return [e.as_dict() for e in events]

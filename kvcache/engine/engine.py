"""Engine: a small inference engine whose outputs prove that block reuse is correct.

    engine = Engine("tiny", KvCacheConfig(...), attn_backend="torch")
    outs = engine.generate(prompts, max_new_tokens=8)

The Engine builds the parts from its options (model, cache manager, KV storage, backend,
block table, persistent batch, scheduler, CUDA graphs, snapshots) and is the thread-safe
request API: add_request, abort, step, generate. What one step does (schedule, apply the
manager's copies, metadata, plan, forward, sample, commit) is kvcache/engine/step_runner.py.
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
from kvcache.attention.registry import get_backend
from kvcache.core.config import KvCacheConfig
from kvcache.core.keys import ReuseScope
from kvcache.core.manager import DEFAULT_PRIORITY, KVCacheManager
from kvcache.core.stats import KvCacheStats
from kvcache.core.validate import check_positive_int, check_priority
from kvcache.core.window import peak_blocks
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
from kvcache.engine.step_runner import StepRunner
from kvcache.engine.step_timer import StepTimer
from kvcache.model.config import get_preset
from kvcache.model.transformer import Transformer
from kvcache.storage.kv_storage import KvLayout, KvStorage

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32)
# Admission into an idle engine fails only transiently (all blocks are then free or
# evictable, and add_request rejects what could never fit); give up after this many.
MAX_IDLE_STEPS = 8


def _backend_class(attn_backend: str | type[AttentionBackend]) -> type[AttentionBackend]:
    """The class `attn_backend` names, or the class itself; ValueError otherwise."""
    if not isinstance(attn_backend, type):
        return get_backend(attn_backend)
    if not issubclass(attn_backend, AttentionBackend):
        raise ValueError(f"Engine: attn_backend class {attn_backend.__qualname__} is not an "
                         "AttentionBackend")
    return attn_backend


def _kv_storage(cfg: KvCacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device, layout: KvLayout) -> KvStorage:
    """The engine's KV storage for `cfg`'s pools. Raises ValueError naming
    `KvCacheConfig.max_num_blocks` and `host_cache_blocks` and the bytes they ask for
    when torch cannot allocate it (out of memory: RuntimeError or MemoryError)."""
    try:
        return KvStorage(num_layers=num_layers, num_blocks=cfg.max_num_blocks,
                         block_size=cfg.tokens_per_block, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype, device=device, layout=layout,
                         host_num_blocks=cfg.host_cache_blocks)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        per_block = (2 * num_layers * cfg.tokens_per_block * num_kv_heads * head_dim
                     * dtype.itemsize)
        host = (f" and KvCacheConfig.host_cache_blocks={cfg.host_cache_blocks} host blocks "
                f"({cfg.host_cache_blocks * per_block} bytes)" if cfg.host_cache_blocks else "")
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"Engine: cannot allocate the KV storage on {device}: "
                         f"KvCacheConfig.max_num_blocks={cfg.max_num_blocks} device blocks "
                         f"({cfg.max_num_blocks * per_block} bytes){host}, {per_block} bytes "
                         f"a block; lower them (torch: {reason})") from e


class Engine:
    """Greedy generation over a paged KV cache with block reuse.

    `model` is a Transformer or a preset name (weights from `seed`). `attn_backend` is a
    registered backend's name or an AttentionBackend subclass (a backend outside the
    registry, e.g. a test's fault-injecting one). `max_num_tokens` is
    the per-step token budget, `max_batch_size` the running requests. `pad_decode` pads
    decode batches to `graph_batch_sizes` as CUDA-graph replay does (`cuda_graph=True`
    captures them; it needs CUDA and the flashinfer backend). `layout` ("NHD"/"HND": a K
    and a V pool per layer; "BLHNC": one packed K and V for all layers, block-major) and
    `page_size` (a divisor of the block size: re-paging) shape the KV storage the backend
    reads. `record_events` keeps the cache's admission log for the reuse oracle.
    `share_prefixes` holds a request back while a running one of the same scope still
    computes the full blocks their prompts share, then admits it with reuse (in-batch
    prefix sharing; see kvcache/engine/prefix_sharing.py). `kv_events` records KV-cache
    events for routers (`engine.manager.take_kv_events()`). For a model whose attention
    layers use a sliding window, `release_outside_window` lets the cache release a
    running request's blocks no later token can see and match warm prompts by the
    window (see `resolve_window`); False keeps full-attention bookkeeping. A model that
    mixes windowed and full-attention layers keeps full-attention bookkeeping, and
    `backend` is then a LayerWindows, one member backend per window (`attn_backend`
    keeps the registered name). Raises ValueError naming the bad option (and for a KV
    storage torch cannot allocate, the `KvCacheConfig` sizes and the bytes). Set
    `step_timer` to a StepTimer to time every step's phases (schedule, metadata, plan,
    forward, sample, commit).

    Thread-safe: add_request, step, abort and generate take one fair lock (`FairLock`),
    so requests may arrive from other threads while one thread runs the step loop; such
    a call waits for at most the step in progress, never for the work to drain. Every
    public read is safe from any thread too: has_unfinished, kv_cache_stats and
    admission_log take the lock (a metrics thread polling them waits for at most one
    step, and reads no half-made step); num_steps, num_computed_tokens, step_timer and
    idle read one value, without the lock. The parts (manager, scheduler, storage, ...)
    are not thread-safe: read them only from the thread that steps, or under the lock.
    """

    def __init__(self, model: Transformer | str, cache_config: KvCacheConfig, *,
                 attn_backend: str | type[AttentionBackend] = "torch", max_num_tokens: int = 512,
                 max_batch_size: int = 16, enable_chunked_prefill: bool = True,
                 share_prefixes: bool = True, kv_events: bool = False,
                 state_snapshot_interval: int = 1, release_outside_window: bool = True,
                 cuda_graph: bool = False, pad_decode: bool | None = None,
                 graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_SIZES,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 layout: KvLayout = "NHD", page_size: int | None = None, seed: int = 0,
                 record_events: bool = True, backend_options: dict[str, Any] | None = None
                 ) -> None:
        max_num_tokens = check_positive_int(max_num_tokens, "Engine: max_num_tokens")
        max_batch_size = check_positive_int(max_batch_size, "Engine: max_batch_size")
        if not isinstance(cache_config, KvCacheConfig):
            raise ValueError(f"Engine: cache_config must be a KvCacheConfig, got {cache_config!r}")
        self.device = torch.device(device)
        if cuda_graph and not torch.cuda.is_available():
            raise ValueError("Engine: cuda_graph=True needs CUDA, but torch.cuda.is_available() "
                             "is False on this machine")
        backend_cls = _backend_class(attn_backend)
        if cuda_graph and backend_cls.name != "flashinfer":
            raise ValueError(f"Engine: cuda_graph=True needs attn_backend='flashinfer', "
                             f"got {attn_backend!r}")
        if isinstance(model, str):
            model = Transformer(get_preset(model), seed=seed)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        mc = model.config
        if cuda_graph and mc.has_recurrent_layers:
            raise ValueError("Engine: cuda_graph=True is unsupported for models with "
                             "recurrent layers")
        interval = check_positive_int(state_snapshot_interval,
                                      "Engine: state_snapshot_interval")
        windowed = resolve_window(cache_config, backend_cls, model, release_outside_window)
        self.cache_config, self.reuse_disabled_reason = resolve_reuse(
            windowed, backend_cls, model, interval)
        B = cache_config.tokens_per_block
        self.manager = KVCacheManager(self.cache_config, record_events=record_events,
                                      kv_events=kv_events)
        self.snapshots: StateSnapshots | None = None  # hybrid models with reuse on
        if mc.has_recurrent_layers and self.cache_config.block_reuse:
            self.snapshots = StateSnapshots(mc.recurrent_layers, mc.hidden_size, interval)
            self.manager.on_blocks_removed = self.snapshots.drop
            if self.cache_config.host_cache_blocks:  # snapshots follow blocks to the host
                self.manager.add_tier_listener(self.snapshots)
        self.storage = _kv_storage(self.cache_config, max(1, len(mc.attention_layers)),
                                   mc.num_kv_heads, mc.head_dim, dtype, self.device, layout)
        self.graph_batch_sizes = tuple(sorted(graph_batch_sizes)) if (
            cuda_graph or pad_decode) else ()
        options = dict(backend_options or {})
        if cuda_graph:
            options["graph_batch_sizes"] = self.graph_batch_sizes
        self.attn_backend = backend_cls.name
        # Storage layer i is model layer attention_layers[i]; with no attention layer the
        # storage still has one (unused), at the model's window.
        windows = [mc.layer_window_left(i) for i in mc.attention_layers] or [mc.window_left]
        self.backend = backend_for_windows(backend_cls, windows, storage=self.storage,
                                           num_qo_heads=mc.num_heads,
                                           num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                           page_size=page_size, **options)
        self.max_model_len = mc.max_position_embeddings
        # A request never holds more blocks than the pool has (add_request rejects it), so
        # the table is sized by the pool, never by the model's maximum length alone.
        self.table = BlockTable(max_batch_size, min(-(-self.max_model_len // B),
                                                    cache_config.max_num_blocks))
        self.batch = PersistentBatch(self.table, block_size=B, page_size=self.backend.page_size,
                                     page_index_multiplier=self.backend.page_index_multiplier,
                                     max_padded=max(self.graph_batch_sizes, default=None))
        self.max_num_tokens = max_num_tokens
        self.chunked = enable_chunked_prefill
        self.scheduler = Scheduler(self.manager, self.table, self.batch,
                                   max_num_tokens=max_num_tokens, max_batch_size=max_batch_size,
                                   chunked=enable_chunked_prefill, share_prefixes=share_prefixes)
        self.graphs = DecodeGraphs(self.model, self.backend, self.graph_batch_sizes,
                                   self.device) if cuda_graph else None
        self.runner = StepRunner(model=self.model, backend=self.backend, manager=self.manager,
                                 scheduler=self.scheduler, storage=self.storage,
                                 batch=self.batch, graphs=self.graphs,
                                 graph_batch_sizes=self.graph_batch_sizes,
                                 snapshots=self.snapshots, device=self.device)
        self._lock = FairLock()
        self._next_rid = 0
        self._awaited: set[int] = set()  # requests some generate() call is waiting for
        self._outputs: dict[int, GenerationOutput] = {}  # their outputs, until collected
        self._unclaimed: list[GenerationOutput] = []  # others' outputs, for the next step()
        self.idle = False  # the last step scheduled nothing

    @classmethod
    def from_pretrained(cls, path: str | Path, cache_config: KvCacheConfig, *,
                        check_finite: bool = True, **options: Any) -> Engine:
        """An engine over an HF-format checkpoint (config.json + *.safetensors): `path` is
        its folder or config.json; `check_finite=False` skips the NaN/inf scan of the
        weights; `options` go to Engine(). Raises what `load_pretrained` raises (naming
        the file and what is wrong) and what Engine() raises."""
        from kvcache.model.checkpoint import load_pretrained

        dtype = options.get("dtype", torch.float32)
        device = options.get("device", "cpu")
        model = load_pretrained(path, dtype=dtype, device=device, check_finite=check_finite)
        return cls(model, cache_config, **options)

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
    def step_timer(self) -> StepTimer | None:
        """Times every step's phases when set (None: untimed). Read from any thread
        without the lock; setting it takes the lock (it applies from the next step)."""
        return self.runner.timer

    @step_timer.setter
    def step_timer(self, timer: StepTimer | None) -> None:
        with self._lock:
            self.runner.timer = timer

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], max_new_tokens: int,
                    scope: ReuseScope | None = None, *, priority: int = DEFAULT_PRIORITY,
                    force_tokens: Sequence[int] | None = None,
                    return_logits: bool = True) -> int:
        """Queue a request; returns its id. `force_tokens` replaces greedy sampling
        (teacher forcing). Raises ValueError naming the bad value for bad input or a
        request that could never fit the model, the pool or (unchunked) the budget."""
        with self._lock:
            rid = self._next_rid
            where = f"add_request(#{rid})"
            vocab = self.model.config.vocab_size
            tokens = check_tokens(prompt, vocab, f"{where}: prompt")
            if not tokens:
                raise ValueError(f"{where}: empty prompt")
            max_new_tokens = check_positive_int(max_new_tokens, f"{where}: max_new_tokens")
            total = len(tokens) + max_new_tokens
            if total > self.max_model_len:
                raise ValueError(f"{where}: prompt of {len(tokens)} tokens + {max_new_tokens} "
                                 f"new exceeds the model's maximum of {self.max_model_len}")
            blocks = self._blocks_needed(len(tokens), total)
            if blocks > self.cache_config.max_num_blocks:
                raise ValueError(f"{where}: needs {blocks} blocks, the pool has only "
                                 f"{self.cache_config.max_num_blocks}: it can never fit")
            if not self.chunked and total > self.max_num_tokens:
                raise ValueError(f"{where}: {total} tokens exceed max_num_tokens="
                                 f"{self.max_num_tokens} without chunked prefill")
            forced = None
            if force_tokens is not None:
                forced = check_tokens(force_tokens, vocab, f"{where}: force_tokens")
                if len(forced) < max_new_tokens:
                    raise ValueError(f"{where}: force_tokens has {len(forced)} tokens, "
                                     f"max_new_tokens is {max_new_tokens}")
            if scope is not None and not isinstance(scope, ReuseScope):
                raise ValueError(f"{where}: scope must be None or ReuseScope, got {scope!r}")
            priority = check_priority(priority, where)
            self._next_rid += 1
            self.scheduler.waiting.append(Request(rid, tokens, max_new_tokens, scope, priority,
                                                  forced, return_logits))
            return rid

    def _blocks_needed(self, prompt_len: int, total: int) -> int:
        """The most blocks a request holds at once: all of them under full attention;
        under a sliding window its window and one step's chunk (kvcache/core/window.py)."""
        cfg = self.cache_config
        B = cfg.tokens_per_block
        if cfg.sliding_window is None:
            return -(-total // B)
        chunk = self.max_num_tokens if self.chunked else prompt_len
        return peak_blocks(prompt_len, total, chunk, cfg.sliding_window - 1, B, cfg.block_reuse)

    def abort(self, rid: int) -> GenerationOutput:
        """Cancel request `rid`; its blocks are released, what it committed stays cached.

        Returns its partial output (finish reason ABORTED); a generate() call waiting for
        the request returns the same output in its place. Raises RequestFinishedError (a
        ValueError) if the request already finished or was aborted, and ValueError for
        an id this engine never issued.
        """
        with self._lock:
            if isinstance(rid, bool) or not isinstance(rid, int | np.integer) \
                    or not 0 <= rid < self._next_rid:
                issued = (f"ids 0 to {self._next_rid - 1} were issued" if self._next_rid
                          else "no request was added yet")
                raise ValueError(f"abort({rid!r}): no such request; {issued}")
            req = self.scheduler.remove(int(rid))
            if req is None:
                raise RequestFinishedError(f"abort(#{rid}): request #{rid} already finished "
                                           "or was aborted; nothing to abort")
            out = req.output(FinishReason.ABORTED)
            if req.rid in self._awaited:
                self._outputs[req.rid] = out
            return out

    def has_unfinished(self) -> bool:
        """True while any request waits or runs. Takes the lock (safe from any thread: a
        request moving from waiting to running is never missed)."""
        with self._lock:
            return len(self.scheduler) > 0

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[GenerationOutput]:
        """Run one step; returns the requests that finished in it, and any that finished
        earlier inside some generate() call that was not waiting for them.

        A step whose copies or forward raise (CUDA out of memory, an interrupt) did not
        happen: the error propagates, every request keeps what it had (KV, recurrent
        state, tokens, counts), the copies not applied stay queued, and the next step()
        runs the same work again (kvcache/engine/step_runner.py)."""
        with self._lock:
            finished = self._unclaimed + self._step()
            self._unclaimed = []
            return finished

    def _step(self) -> list[GenerationOutput]:
        """One step; outputs some generate() awaits are parked for it, the rest returned."""
        done = self.runner.run()
        self.idle = done is None
        finished = []
        for out in done or ():
            if out.request_id in self._awaited:
                self._outputs[out.request_id] = out
            else:
                finished.append(out)
        return finished

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8,
                 scopes: Sequence[ReuseScope | None] | None = None, *,
                 return_logits: bool = True,
                 force_tokens: Sequence[Sequence[int]] | None = None) -> list[GenerationOutput]:
        """Run `prompts` (a list of token lists) to completion; outputs in prompt order.

        A request another thread aborts meanwhile is returned as aborted (its partial
        output, finish reason ABORTED). Raises ValueError naming the bad value for bad
        input (nothing is queued then), RuntimeError if its requests stay unadmittable.
        Whatever a step raises (a forward or a copy that failed) propagates, after the
        call aborted every request it added that is still queued or running: their
        blocks are freed (what they committed stays cached), none is left to come out
        of another caller's step(), and the engine stays usable (a step that raised did
        not happen; see `step`).
        """
        check_prompts(prompts)
        if scopes is not None and len(scopes) != len(prompts):
            raise ValueError(f"generate: {len(scopes)} scopes for {len(prompts)} prompts")
        if force_tokens is not None and len(force_tokens) != len(prompts):
            raise ValueError(f"generate: {len(force_tokens)} force_tokens for "
                             f"{len(prompts)} prompts")
        rids: list[int] = []
        with self._lock:
            try:
                for i, p in enumerate(prompts):
                    rids.append(self.add_request(
                        p, max_new_tokens, scopes[i] if scopes else None,
                        force_tokens=force_tokens[i] if force_tokens else None,
                        return_logits=return_logits))
            except ValueError:
                for rid in rids:  # all or nothing: no orphan requests left queued
                    self.scheduler.remove(rid)
                if rids:
                    self._next_rid = rids[0]  # under the lock, so the ids were consecutive
                raise
            self._awaited.update(rids)
        try:
            return self._wait_for(rids)
        except BaseException:
            with self._lock:
                for rid in rids:  # what has no output yet is still queued or running
                    if rid not in self._outputs:
                        self.scheduler.remove(rid)
            raise
        finally:
            with self._lock:
                self._awaited.difference_update(rids)
                for rid in rids:
                    self._outputs.pop(rid, None)

    def _wait_for(self, rids: list[int]) -> list[GenerationOutput]:
        stalls = 0
        while True:
            with self._lock:
                if all(r in self._outputs for r in rids):
                    return [self._outputs[r] for r in rids]
                self._unclaimed += self._step()  # a step-loop caller's outputs wait for it
                stalls = stalls + 1 if self.idle and not self.scheduler.running else 0
                if stalls > MAX_IDLE_STEPS:
                    # Aborted requests have outputs by now: what is left is still waiting
                    # (generate removes it).
                    stalled = [r.rid for r in self.scheduler.waiting if r.rid in rids]
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
        if self.manager.events is None:
            raise ValueError("admission_log: the engine was built with record_events=False")
        with self._lock:
            return [e.as_dict() for e in self.manager.events]

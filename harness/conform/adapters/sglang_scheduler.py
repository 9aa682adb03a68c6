"""SGLang's own scheduler code driving its prefix cache (0.5.22 on; 0.5.18's older form
is `sglang_legacy`'s hooks), behind the protocol.

From 0.5.22 the code that calls the tree runs on a CPU, so the adapter calls it rather
than copying it (runs in an SGLang venv whose lock keeps the real device pools):

- the pools are SGLang's: `ReqToTokenPool` and `PagedTokenToKVPoolAllocator` built on
  device "cpu" (as SGLang's own CPU tests build them), with a one-layer
  `MHATokenToKVPool`; the process's runtime config is published from
  `ServerArgs(device="cpu", attention_backend="torch_native")`, so the allocator and
  the batch take their CPU paths;
- a request is SGLang's `Req` (its `__init__` joins the extra key and the LoRA id),
  matched by `Req.init_next_round_input` (`_compute_max_prefix_len`, `match_kv_cache`);
- admission is `PrefillAdder.add_one_req`, which also cuts the first chunk (asked as
  the step's `rem_chunk_tokens`), and a later chunk `add_chunked_req`; opened with a
  `chunk_budget` (`CacheOptions`), the step's `rem_chunk_tokens` is that budget, as
  `--chunked-prefill-size` sets it (`server_budget`), and PrefillAdder cuts the chunks
  itself (the contract's "page-budget"); the scheduled
  tokens are allocated by `ScheduleBatch.prepare_for_extend` (`alloc_for_extend`:
  the request row, the shortfall eviction, the pages) and a decode step by
  `check_decode_mem` and `prepare_for_decode`;
- when a step's forward pass is done (a commit of every scheduled token) the result
  processor's cache calls run: `checkpoint_kv_cache` after an extend, nothing after a
  decode step; a finished request is `release_kv_cache(checkpoint=True)` (its decoded
  tokens enter the tree only then), an aborted one `release_kv_cache(checkpoint=False)`,
  a preempted one `release_req` (SGLang's retraction), resumed as the same `Req`;
- the tree is `RadixCache` or `UnifiedRadixCache` (full attention), built with
  `KvEventLoraNames` that the adapter fills as the scheduler does. A UnifiedRadixCache
  opened with more is a subclass's, through `SglangScheduled`'s hooks: with a window
  FULL+SWA (`sglang_window`), with a `state_interval` FULL+MAMBA (`sglang_mamba`), with
  `host_blocks` a hierarchical one (`sglang_hicache`); `sglang_options` chooses it
  and writes its contract. `SchedulerNames` says which of them this release has.

What stays replicated is listed in `REPLICATED` (the contract's `replicated`). The
admission budget reserves no decode tokens (`SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION=0`,
set before SGLang is imported): the protocol never says how many tokens a request will
decode, and SGLang's estimate would refuse every prompt in a pool of a few pages.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from harness.conform.adapters.sglang_tree import (
    SglangTree,
    has_module,
    page_problems,
    radix_tree_pages,
)
from harness.conform.protocol import Admission, Contract, Scope, Stats, lora_id_text

# SGLang's admission estimate of the tokens a request will decode, clipped to this
# (`schedule_policy.CLIP_MAX_NEW_TOKENS`, read at import): none, see the docstring
CLIP_ENV = ("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "0")
MAX_REQUESTS = 128  # rows of the ReqToTokenPool
MAX_CONTEXT = 2048  # tokens per row
_UNLIMITED = 1 << 30  # max_new_tokens, rem_input_tokens: no limit the protocol knows
PAGED = "sglang.srt.mem_cache.allocator.paged"
EVENTS = "sglang.srt.mem_cache.events"
PROCESSOR = "sglang.srt.managers.scheduler_components.batch_result_processor"
MAMBA_RADIX = "sglang.srt.mem_cache.mamba_radix_cache"
# UnifiedRadixCache's components: COMPONENTS.swa and .mamba from 0.5.20, .swa_component
# and .mamba_component in 0.5.19
COMPONENTS = "sglang.srt.mem_cache.unified_cache.components"
# why MambaRadixCache is not driven from 0.5.16 (`_mamba_radix_names`)
UNIFIED_MAMBA = ("this release's server builds a hybrid Mamba model's tree as "
                 "UnifiedRadixCache's MAMBA component (mem_cache/registry.py "
                 "default_radix_cache_factory), not MambaRadixCache; the unified tree's "
                 "is driven from 0.5.22 (sglang_unified)")
MODULES = ("sglang.srt.managers.schedule_batch", "sglang.srt.managers.schedule_policy",
           "sglang.srt.mem_cache.common", "sglang.srt.mem_cache.memory_pool",
           "sglang.srt.mem_cache.allocator", "sglang.srt.server_args")

REPLICATED: tuple[tuple[str, str, str], ...] = (
    ("the order of a step's cache calls: admission, allocation, then (when the op list "
     "says the forward pass is done) the result processor's",
     "Scheduler.event_loop_normal / get_next_batch_to_run / process_batch_result",
     "the scheduler loop runs a model; the adapter makes one batch per op"),
    ("which release an ended request takes: finished (every token computed) or "
     "aborted (release_kv_cache with checkpoint=False)",
     "SchedulerBatchResultProcessor.process_batch_result_prefill / _decode, "
     "Scheduler.process_pending_chunked_abort",
     "the finish conditions (stop tokens, max_new_tokens) are the model's output"),
    ("a decode step's sampled token appended to Req.output_ids (before 0.5.13 also the "
     "batch's output_ids, which its prepare_for_decode reads)",
     "process_batch_result_decode (before 0.5.13 Scheduler.run_batch)",
     "no model samples it; the op list gives it"),
    ("the ModelConfig a batch reads (vocab_size, is_encoder_decoder; is_matryoshka before "
     "0.5.13)",
     "ModelConfig", "it is built from a model checkpoint"),
    ("which requests a retraction picks (the op list names it)",
     "ScheduleBatch.retract_decode", "the protocol preempts one named sequence"),
)


def present() -> bool:
    """Whether this release's scheduler code is the kind the adapter drives:
    `release_kv_cache` in its cache module and SGLang's retraction, `release_req` (a
    function of `schedule_batch` from 0.5.13, a `ScheduleBatch` method before; 0.5.22 on
    add `checkpoint_kv_cache`, `checkpointing`, and before it `sglang_legacy` drives the
    tree's `cache_unfinished_req`), read from its files without importing them; call
    after `sglang.srt.mem_cache` is imported."""
    batch = source_text("sglang.srt.managers.schedule_batch")
    return "def release_kv_cache(" in source_text("sglang.srt.mem_cache.common") \
        and ("\ndef release_req(" in batch or "    def release_req(self, idx" in batch)


def checkpointing() -> bool:
    """Whether the result processor checkpoints through `checkpoint_kv_cache` (0.5.22
    on), read from the release's cache module as `present` reads."""
    return "def checkpoint_kv_cache(" in source_text("sglang.srt.mem_cache.common")


def source_text(module: str) -> str:
    """`module`'s source text, read without importing it; "" where it has none."""
    spec = importlib.util.find_spec(module)
    return Path(spec.origin).read_text() if spec and spec.origin else ""


class SchedulerNames:
    """The SGLang scheduler names the adapter calls, imported once (after
    `set_environment`)."""

    def __init__(self) -> None:
        import torch
        from sglang.srt.managers import schedule_batch, schedule_policy
        from sglang.srt.mem_cache import common, memory_pool
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.torch = torch
        self.schedule_batch, self.schedule_policy, self.common = \
            schedule_batch, schedule_policy, common
        self.Req = schedule_batch.Req
        self.ScheduleBatch = schedule_batch.ScheduleBatch
        self.FINISH_LENGTH = schedule_batch.FINISH_LENGTH
        self.PrefillAdder = schedule_policy.PrefillAdder
        self.ReqToTokenPool = memory_pool.ReqToTokenPool
        self.MHATokenToKVPool = memory_pool.MHATokenToKVPool
        # the paged allocator's module: a package's `paged` from 0.5.13, a module before
        paged = importlib.import_module(
            PAGED if has_module(PAGED) else "sglang.srt.mem_cache.allocator")
        self.PagedAllocator = paged.PagedTokenToKVPoolAllocator
        self.CacheInitParams = CacheInitParams
        # the result processor's checkpoint (0.5.22 on); before, the tree's own
        # cache_unfinished_req (`sglang_legacy.LegacyScheduled`)
        self.checkpoints = hasattr(common, "checkpoint_kv_cache")
        # where an extend's allocation evicts and takes pages (the report's trace):
        # common.py before 0.5.16, allocation.py from it
        self.allocation = common if hasattr(common, "alloc_paged_token_slots_extend") \
            else importlib.import_module("sglang.srt.mem_cache.allocation")
        # the table of LoRA names the scheduler fills for KV events (0.5.22 on; None
        # before, whose events name no LoRA): from 0.5.23 it also names each request's
        # namespace (register(req, name)), which makes the default event format
        # namespace a LoRA's blocks
        events = importlib.import_module(EVENTS) if has_module(EVENTS) else None  # 0.5.12 on
        self.LoraNames: Any = getattr(events, "KvEventLoraNames", None) \
            or getattr(events, "LoRANameTable", None)
        self.names_requests = self.LoraNames is not None and \
            "req" in inspect.signature(self.LoraNames.register).parameters
        self.SamplingParams = SamplingParams
        self.ServerArgs = ServerArgs
        self.publish = _publisher()
        self.NO_SPEC = SpeculativeAlgorithm.NONE
        self.clip = schedule_policy.CLIP_MAX_NEW_TOKENS
        # (page, state block, host tier's ServerArgs)
        self.published: tuple[Any, ...] | None = None
        self.server_args: Any = None  # the ServerArgs published last
        self.swa = _swa_names()
        # the hierarchical cache (UnifiedRadixCache.init_hicache over pool_host.mha)
        self.hicache = has_module("sglang.srt.mem_cache.pool_host.mha") \
            and has_module("sglang.srt.mem_cache.unified_radix_cache")
        self.mamba, self.no_mamba = _mamba_names()
        # before 0.5.21 a Mamba state is MambaRadixCache's, beside RadixCache
        self.mamba_radix, self.no_mamba_radix = _mamba_radix_names() \
            if not self.checkpoints else (None, "")

    def publish_config(self, page_size: int, state_tokens: int | None = None,
                       host: dict[str, Any] | None = None) -> None:
        """Publish the process's runtime config for `page_size` (SGLang keeps one per
        process; re-publishing replaces it); with `state_tokens`, a hybrid Mamba model's
        with the extra buffer and that Mamba cache chunk (preset as SGLang's own test
        fixture does for a model without an HF config,
        `test/kits/unified_radix_cache/fixtures.py` `build_fixture`), a decode state
        tracked every `state_tokens` tokens too (`mamba_track_interval`, 256 by default,
        a multiple of the page: `arg_groups/mamba_hook.py:135`); with `host`, those
        ServerArgs too (a host tier's: `sglang_hicache.host_args`)."""
        key = (page_size, state_tokens, tuple(sorted((host or {}).items())))
        if self.published == key:
            return
        extra: dict[str, Any] = dict(host or {})
        if state_tokens is not None:
            # the option's name before 0.5.14
            strategy = "mamba_scheduler_strategy" \
                if hasattr(self.ServerArgs, "mamba_scheduler_strategy") \
                else "mamba_radix_cache_strategy"
            extra.update({strategy: "extra_buffer", "mamba_track_interval": state_tokens})
        args = self.ServerArgs(model_path="dummy", device="cpu", page_size=page_size,
                               attention_backend="torch_native",
                               disable_overlap_schedule=True, **extra)
        if state_tokens is not None:
            args._mamba_cache_chunk_size = state_tokens
        self.publish(args, role="scheduler")
        self.published, self.server_args = key, args


def _publisher() -> Callable[..., Any]:
    """How the server publishes its ServerArgs to the process: `runtime_context.publish`
    (0.5.17 on), else `server_args.set_global_server_args_for_scheduler` (0.5.13-0.5.16;
    0.5.16's is `get_context().set_server_args`), which takes no role."""
    from sglang.srt import server_args

    if has_module("sglang.srt.runtime_context"):
        publish = getattr(importlib.import_module("sglang.srt.runtime_context"), "publish",
                          None)
        if publish is not None:
            return cast(Callable[..., Any], publish)
    legacy = server_args.set_global_server_args_for_scheduler
    return lambda args, role: legacy(args)


def _swa_names() -> tuple[Any, Any, Any] | None:
    """A hybrid model's sliding-window pools as SGLang's server builds them by default
    (`kv_cache_configurator.py`: `SWAKVPool` and `SWATokenToKVPoolAllocator`, two paged
    allocators, so their CPU paths) and the tree's SWA component: (pool, allocator,
    ComponentType.SWA), or None where this release's UnifiedRadixCache has no SWA
    component (it is then not the tree the adapter drives)."""
    if not any(has_module(f"{COMPONENTS}.{name}") for name in ("swa", "swa_component")):
        return None
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return SWAKVPool, SWATokenToKVPoolAllocator, ComponentType.SWA


def _mamba_names() -> tuple[tuple[Any, Any, Any, Any, Any, Any] | None, str]:
    """A hybrid Mamba model's pools as SGLang's server builds them by default
    (`kv_cache_configurator.py` `_build_hybrid_req_pool`: `HybridReqToTokenPool`, its
    `MambaPool` and `MambaSlotAllocator`; `HybridLinearKVPool` over it), the tree's
    MAMBA component and the result processor that tracks decode states: (request pool,
    KV pool, Mamba2CacheParams, Mamba2StateShape, ComponentType.MAMBA,
    SchedulerBatchResultProcessor) and "", or None and why not: this release's
    UnifiedRadixCache has no MAMBA component, or what the Mamba path imports is not in
    this lock; a module the lock lacks (ModuleNotFoundError) is raised, the lock's to
    fix: `resolve` adds it."""
    if not any(has_module(f"{COMPONENTS}.{name}") for name in ("mamba", "mamba_component")):
        return None, "no MAMBA component in this release's UnifiedRadixCache"
    try:
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.managers.scheduler_components.batch_result_processor import (
            SchedulerBatchResultProcessor,
        )
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    except ModuleNotFoundError:  # a package the lock lacks: the lock's to fix (exit 2)
        raise
    except ImportError as exc:
        return None, f"the Mamba path does not import here ({type(exc).__name__}: {exc})"
    return (HybridReqToTokenPool, HybridLinearKVPool, Mamba2CacheParams, Mamba2StateShape,
            ComponentType.MAMBA, SchedulerBatchResultProcessor), ""


def _mamba_radix_names() -> tuple[tuple[Any, Any, Any, Any, Any, Any] | None, str]:
    """`_mamba_names` for a release before 0.5.22 whose server builds a hybrid Mamba
    model's tree as `MambaRadixCache` (the scheduler's `init_cache` before 0.5.13,
    `mem_cache/registry.py` in 0.5.13-0.5.14; from 0.5.16 the registry builds
    UnifiedRadixCache's MAMBA component, and MambaRadixCache is a module the server does
    not use): the same pools, the tree class in the component's place and the result
    processor; or None and why not. Before 0.5.13 the state grid is the FLA kernel's
    chunk (`ServerArgs.mamba_cache_chunk_size`: max(64, page), a constant no server
    option moves), so no state block of a few pages opens there."""
    if not has_module(MAMBA_RADIX):
        return None, "no MambaRadixCache in this release"
    if "MambaRadixCache(" not in source_text("sglang.srt.mem_cache.registry") \
            and "MambaRadixCache(params" not in source_text("sglang.srt.managers.scheduler"):
        return None, UNIFIED_MAMBA
    if "_mamba_cache_chunk_size" not in source_text("sglang.srt.server_args") \
            or not has_module(PROCESSOR):
        return None, ("its state grid is max(FLA_CHUNK_SIZE = 64, page) tokens "
                      "(server_args.py ServerArgs.mamba_cache_chunk_size), which no "
                      "option moves: a state block of a few pages cannot be opened")
    try:
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

        processor = importlib.import_module(PROCESSOR).SchedulerBatchResultProcessor
    except ModuleNotFoundError:  # as in `_mamba_names`: the lock's to fix
        raise
    except ImportError as exc:
        return None, f"the Mamba path does not import here ({type(exc).__name__}: {exc})"
    return (HybridReqToTokenPool, HybridLinearKVPool, Mamba2CacheParams, Mamba2StateShape,
            MambaRadixCache, processor), ""


def set_environment() -> None:
    """What SGLang must read at import (`CLIP_ENV`); call before importing it."""
    os.environ[CLIP_ENV[0]] = CLIP_ENV[1]


def server_budget(chunk_budget: int | None, page_size: int) -> int | None:
    """The `--chunked-prefill-size` a server takes for an asked `chunk_budget`: whole
    pages (SGLang's validation refuses any other, arg_groups/validation_hook.py:244
    'chunked_prefill_size must be divisible by page_size'), so the largest multiple of
    the page at or below it, at least one page; None (no budget) stays None."""
    if chunk_budget is None:
        return None
    return max(chunk_budget // page_size, 1) * page_size


# where 0.5.22's result processor settles matchable_at and preemption
PROCESSOR_CITATIONS: tuple[tuple[str, str], ...] = (
    ("matchable_at", "mem_cache/common.py checkpoint_kv_cache after an extend "
                     "(batch_result_processor.py, Scheduler.stash_chunked_request); "
                     "release_kv_cache(checkpoint=True) inserts the decoded tokens when "
                     "the request ends"),
    ("preemption", "schedule_batch.py release_req: release_kv_cache(checkpoint=False) "
                   "('TODO: for preempted requests, we may want to insert into the "
                   "tree'), then evict_from_tree_cache for the remaining requests"))


def contract(base: Contract, names: SchedulerNames, chunk_budget: int | None = None
             ) -> Contract:
    """`base` (the tree's contract) as SGLang's scheduler code makes it over its
    full-attention component: with `chunk_budget` (tokens, whole pages:
    `server_budget`), PrefillAdder cutting the chunks ("page-budget"), else the caller
    ("caller-page-floor"). The options beyond the chunk budget, and what each adds, are
    `sglang_options.contract`'s."""
    citations = (*base.citations,
                 *PROCESSOR_CITATIONS,
                 ("decode_steps", "ScheduleBatch.prepare_for_decode: one token per "
                                  "request per step, after the extend's result"),
                 ("refusal_evicts", "allocator.check_decode_capacity and "
                                    "alloc_paged_token_slots_extend evict before they "
                                    "can fail"),
                 ("chunking", "schedule_policy.py PrefillAdder._select_prefill_"
                              "admission: a cut chunk ends on a page boundary; "
                              "add_chunked_req continues up to rem_chunk_tokens (the "
                              "caller's chunk, or --chunked-prefill-size: Scheduler."
                              "_get_new_batch_prefill_raw), after the last chunk's "
                              "result; no other request takes from it without "
                              "--enable-mixed-chunk"),
                 ("admission_fits", "PrefillAdder.add_one_req: the whole remaining "
                                    "prompt plus a page (per_req_token_overhead) must be "
                                    "below free + evictable (prefill_budget.py "
                                    "check_prefill), whatever the chunk"))
    fields, limitations = base.event_fields, base.limitations
    if names.names_requests:
        # 0.5.23: the LoRA's namespace and name reach the events, so the LoRA left out
        # of the hashes (the tree's known limitation, sglang#39991) is not this
        # scheduler's: the reference (salt, LoRA) holds as it is
        fields = (*fields, "lora_name")
        limitations = tuple(x for x in limitations if x[:2] != ("scope_in_event_hash", "lora"))
        citations = tuple(c for c in citations if c[0] != "scope_in_event_hash")
        citations += (("scope_in_event_hash", "mem_cache/events.py KVCacheEventRecorder."
                                              "_namespace_seed: the default format "
                                              "namespaces an extra key KvEventLoraNames "
                                              "names (a LoRA's), not a caller's own"),)
    return replace(base, matchable_at="extend", decode_steps=True, refusal_evicts=True,
                   preemption="retracts-decode",
                   chunking="caller-page-floor" if chunk_budget is None else "page-budget",
                   chunk_budget=chunk_budget,
                   admission_fits="prompt", admission_reserve=2,
                   limitations=limitations, event_fields=fields, replicated=REPLICATED,
                   citations=citations, options=("chunk_budget",),
                   notes=(*base.notes, "SGLang's scheduler functions drive the tree"))


@dataclass
class LiveRequest:
    """One live request."""

    req: Any  # SGLang's Req
    batch: Any  # the ScheduleBatch of its last step
    scope: Scope | None
    length: int  # tokens it has (prompt and appended)
    committed: int = 0  # tokens whose forward pass is done
    extending: bool = True  # an extend is scheduled and its result not processed
    decoding: bool = False  # a decode step is scheduled and its result not processed
    ids: list[int] = field(default_factory=list)  # page ids, as logged


class SglangScheduled(SglangTree):
    """`CacheUnderTest` over SGLang's scheduler functions and one fresh tree
    (`tree_kind` "radix": RadixCache, "unified": UnifiedRadixCache's full-attention
    component), page_size = block_size, opened as `contract` says (its `chunk_budget`,
    whole pages: `server_budget`; the options that make another tree are its
    subclasses': `sglang_window.WindowScheduled`, `sglang_mamba.MambaScheduled`,
    `sglang_hicache.HostScheduled`, chosen by `sglang_options.scheduled`).

    What a subclass's tree adds, it adds through these hooks (each doing what the plain
    full-attention path does): `_state_tokens` and `_host_args` (the published config),
    `_request_pool` and `_kv_pools` (SGLang's pools), `_components`, `_tree_params` and
    `_open_unified` (the tree), `_refused`, `_prepare_decode` and `_decode_result` (the
    steps), `_evictable` and `_protected` (the tree's full-attention gauges), `_gauges`
    and `_problems` (the stats and the integrity check)."""

    def __init__(self, s: Any, names: SchedulerNames, tree_kind: str, contract: Contract,
                 num_blocks: int, block_size: int, record: bool) -> None:
        self.s, self.n = s, names  # the tree's names (SglangNames), the scheduler's
        self.tree_kind = tree_kind
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.record = record
        self._contract = contract
        self.chunk_budget = contract.chunk_budget  # each step's, or the op's
        names.publish_config(block_size, self._state_tokens(), self._host_args())
        self.rows = self._request_pool()
        self.kv, self.alloc, self.full = self._kv_pools()  # full: the full-attention pages'
        self.lora_names = names.LoraNames() if names.LoraNames is not None else None
        self.tree = self._build_tree()
        if record:  # the tree's reset in its __init__ publishes AllBlocksCleared: no op's
            self.tree.take_events()
        self.model = _ModelShape(vocab_size=1 << 20, is_encoder_decoder=False,
                                 hf_text_config=_TextConfig(self._state_tokens() or block_size))
        self._live: dict[Hashable, LiveRequest] = {}
        self._retracted: dict[Hashable, Any] = {}  # seq -> its retracted Req
        self._preempted: list[Hashable] = []  # retracted since take_preempted
        self._log: list[dict[str, Any]] = []

    # -- the hooks of a tree with more than full attention -----------------------------------

    def _state_tokens(self) -> int | None:
        """Tokens per Mamba state block (none here: `MambaScheduled`'s)."""
        return None

    def _host_args(self) -> dict[str, Any] | None:
        """The ServerArgs of the cache's host tier (none here: `HostScheduled`'s)."""
        return None

    def _request_pool(self) -> Any:
        """SGLang's request pool: a `ReqToTokenPool` of `MAX_REQUESTS` rows."""
        return self.n.ReqToTokenPool(size=MAX_REQUESTS, max_context_len=MAX_CONTEXT,
                                     device="cpu", enable_memory_saver=False)

    def _kv_pools(self) -> tuple[Any, Any, Any]:
        """(KV pool, allocator, the full-attention pages' allocator): a one-layer
        `MHATokenToKVPool` and a `PagedTokenToKVPoolAllocator` over it (the same)."""
        n, P = self.n, self.block_size
        kv = n.MHATokenToKVPool(self.num_blocks * P, P, n.torch.float16, head_num=1,
                                head_dim=8, layer_num=1, device="cpu",
                                enable_memory_saver=False)
        alloc = n.PagedAllocator(self.num_blocks * P, P, n.torch.float16, "cpu", kv,
                                 need_sort=False)
        return kv, alloc, alloc

    def _components(self) -> tuple[Any, ...]:
        """A UnifiedRadixCache's components, in SGLang's order: FULL here."""
        return (self.s.FULL,)

    def _tree_params(self) -> dict[str, Any]:
        """The `CacheInitParams` a UnifiedRadixCache's components add: none here."""
        return {}

    def _cache_params(self) -> dict[str, Any]:
        """The `CacheInitParams` every tree here takes: the pools, the page, the events
        (and the LoRA names they carry, where the release has the table)."""
        params: dict[str, Any] = dict(
            disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc,
            page_size=self.block_size, enable_kv_cache_events=self.record)
        if self.lora_names is not None:
            params["kv_event_lora_names"] = self.lora_names
        return params

    def _build_tree(self) -> Any:
        n, s = self.n, self.s
        params = self._cache_params()
        if self.tree_kind == "unified":
            return self._open_unified(n.CacheInitParams(
                **params, **self._tree_params(), tree_components=self._components()))
        return s.RadixCache(n.CacheInitParams(**params))

    def _open_unified(self, params: Any) -> Any:
        """A UnifiedRadixCache from its `CacheInitParams`."""
        return self.s.UnifiedRadixCache(params)

    def _refused(self, req: Any) -> None:
        """A request the adder did not admit leaves the queue: nothing to give back here."""

    def _prepare_decode(self, batch: Any) -> None:
        """A decode step's allocation: `prepare_for_decode`."""
        batch.prepare_for_decode()

    def _decode_result(self, live: LiveRequest) -> None:
        """A decode step's forward pass is done: the full-attention path's result touches
        no cache."""
        live.decoding = False

    def _evictable(self) -> int:
        """The tree's evictable full-attention tokens (`evictable_size`)."""
        return int(self.tree.evictable_size())

    def _protected(self) -> int:
        """The tree's locked full-attention tokens (`protected_size`)."""
        return int(self.tree.protected_size())

    def _gauges(self) -> dict[str, int | float]:
        """The gauges of the tree's other components and their pools: none here."""
        return {}

    def _problems(self) -> list[str]:
        """What is wrong with the tree's other components and their pools: nothing here."""
        return []

    # -- the hooks of a release's Req and result processor (`sglang_legacy`'s before 0.5.22)

    def _prefix_len(self, req: Any) -> int:
        """The tokens of `req` computed before its scheduled extend (matched or earlier)."""
        return int(req.prefix_len)

    def _extend_end(self, req: Any) -> int:
        """Where `req`'s scheduled extend ends."""
        return int(req.extend_end)

    def _unschedule(self, req: Any) -> None:
        """A chunk whose allocation failed was not scheduled: its extend ends where it
        starts."""
        req.extend_end = req.prefix_len

    def _kv_field(self, req: Any, name: str) -> int:
        """One of `req`'s row and lengths (`req_pool_idx`, `kv_committed_len`,
        `kv_allocated_len`, `cache_protected_len`): on its `ReqKvInfo`."""
        return int(getattr(req.kv, name))

    def _row_index(self, req: Any) -> int:
        """`req`'s row of the request pool."""
        return self._kv_field(req, "req_pool_idx")

    def _committed_len(self, req: Any) -> int:
        """The tokens of `req` whose KV the forward passes wrote."""
        return self._kv_field(req, "kv_committed_len")

    def _protected_len(self, req: Any) -> int:
        """The tokens of `req`'s row that are the tree's (locked for it)."""
        return self._kv_field(req, "cache_protected_len")

    def _checkpoint(self, req: Any, last: bool) -> None:
        """The result processor's cache call after an extend (`last`: it computed the
        whole prompt): `checkpoint_kv_cache`."""
        self.n.common.checkpoint_kv_cache(req, self.tree)

    def _release(self, req: Any, checkpoint: bool) -> None:
        """A request ends: `release_kv_cache`, inserting its computed tokens where
        `checkpoint` (it finished), else aborted."""
        self.n.common.release_kv_cache(req, self.tree, checkpoint=checkpoint)

    def _free_pages(self) -> Any:
        """The full-attention allocator's free pages, with repeats (its own census)."""
        return self.full.get_all_free_pages()

    def _retract(self, live: LiveRequest, others: int) -> None:
        """`release_req` of `live`'s request, `others` still decoding."""
        self.n.schedule_batch.release_req(
            req=live.req, remaing_req_count=others, req_to_token_pool=self.rows,
            token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree,
            hisparse_coordinator=None, **self._retraction_args())

    def _retraction_args(self) -> dict[str, Any]:
        """The arguments `release_req` takes beyond the pools and the tree: none here."""
        return {}

    # -- for the self-test -----------------------------------------------------------------

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every SGLang function the adapter calls."""
        n, t = self.n, self.tree
        out: dict[str, tuple[object, str]] = {
            "Req.__init__": (n.Req, "__init__"),
            "Req.init_next_round_input": (n.Req, "init_next_round_input"),
            "Req._compute_max_prefix_len": (n.Req, "_compute_max_prefix_len"),
            "match_kv_cache": (n.common, "match_kv_cache"),
            "checkpoint_kv_cache": (n.common, "checkpoint_kv_cache"),
            "release_kv_cache": (n.common, "release_kv_cache"),
            "release_req": (n.schedule_batch, "release_req"),
            "PrefillAdder.__init__": (n.PrefillAdder, "__init__"),
            "PrefillAdder.add_one_req": (n.PrefillAdder, "add_one_req"),
            "PrefillAdder.add_chunked_req": (n.PrefillAdder, "add_chunked_req"),
            "ScheduleBatch.init_new": (n.ScheduleBatch, "init_new"),
            "ScheduleBatch.prepare_for_extend": (n.ScheduleBatch, "prepare_for_extend"),
            "ScheduleBatch.prepare_for_decode": (n.ScheduleBatch, "prepare_for_decode"),
            "ScheduleBatch.check_decode_mem": (n.ScheduleBatch, "check_decode_mem"),
            "alloc_paged_token_slots_extend": (n.allocation, "alloc_paged_token_slots_extend"),
            "evict_from_tree_cache": (n.common, "evict_from_tree_cache"),
            "ReqToTokenPool.__init__": (n.ReqToTokenPool, "__init__"),
            "PagedTokenToKVPoolAllocator.__init__": (n.PagedAllocator, "__init__"),
            "PagedTokenToKVPoolAllocator.alloc_extend": (n.PagedAllocator, "alloc_extend"),
            "PagedTokenToKVPoolAllocator.alloc_decode": (n.PagedAllocator, "alloc_decode"),
            "LoRA names .register": (n.LoraNames, "register"),
            "match_prefix": (t, "match_prefix"), "insert": (t, "insert"),
            "checkpoint": (t, "checkpoint"), "evict": (t, "evict"),
            "evictable_size": (t, "evictable_size"), "protected_size": (t, "protected_size"),
            "total_size": (t, "total_size"), "take_events": (t, "take_events")}
        if self.tree_kind == "unified":
            out["all_values_flatten"] = (t, "all_values_flatten")
        return out

    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        """The SGLang functions each op kind calls (an allocation evicts leaves when the
        pool is short: `evict_from_tree_cache` asks the tree's `evict`)."""
        extend = ("PrefillAdder.__init__", "ScheduleBatch.init_new",
                  "ScheduleBatch.prepare_for_extend", "alloc_paged_token_slots_extend",
                  "evict_from_tree_cache", "PagedTokenToKVPoolAllocator.alloc_extend",
                  "evict")
        return {"admit": ("Req.__init__", "Req.init_next_round_input", "match_kv_cache",
                          "PrefillAdder.add_one_req", *extend),
                "reserve": ("Req.init_next_round_input", "PrefillAdder.add_chunked_req",
                            *extend),
                "commit": ("checkpoint_kv_cache",),
                "append": ("ScheduleBatch.check_decode_mem", "ScheduleBatch.prepare_for_decode",
                           "PagedTokenToKVPoolAllocator.alloc_decode"),
                "free": ("release_kv_cache",), "preempt": ("release_req",),
                "evict": ("evict",)}

    def raw_probe(self) -> dict[str, Any]:
        """SGLang's own results for one request admitted, computed and ended (its pages
        then evicted)."""
        P = self.block_size
        req = self._new_req("__selftest__", list(range(1, 2 * P + 2)), None)
        out: dict[str, Any] = {"match": req.init_next_round_input(self.tree)}
        batch = self._schedule(req, None)
        assert batch is not None, "the self-test's probe did not fit an empty pool"
        self._checkpoint(req, last=True)
        req.finished_reason = self.n.FINISH_LENGTH(length=0)
        self._release(req, checkpoint=True)
        out.update(req=vars(req), batch=vars(batch), evictable_size=self._evictable())
        self._evict_tokens(2 * P)
        out["take_events"] = self.tree.take_events() if self.record else []
        return out

    # -- SGLang's calls ----------------------------------------------------------------------

    def _new_req(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None) -> Any:
        """SGLang's Req: its __init__ joins the extra key and the LoRA id."""
        n = self.n
        lora = None if scope is None or scope.lora_id is None else lora_id_text(scope.lora_id)
        req = n.Req(str(seq_id), "", self._input_ids(tokens),
                    n.SamplingParams(max_new_tokens=_UNLIMITED), lora_id=lora,
                    **self._scope_keys(scope))
        if lora is not None and self.lora_names is not None:
            assert scope is not None and scope.lora_name is not None
            # as Scheduler.load_lora_adapter and (0.5.23) _record_kv_event_lora_name do
            self.lora_names.register(lora_id=lora, lora_name=scope.lora_name)
            if self.n.names_requests:
                self.lora_names.register(req, scope.lora_name)
        return req

    def _input_ids(self, tokens: Sequence[int]) -> Any:
        """A Req's prompt as its `__init__` takes it: an `array('q')`."""
        return array("q", tokens)

    def _scope_keys(self, scope: Scope | None) -> dict[str, Any]:
        """The Req's key arguments for `scope` beyond its LoRA: the caller's extra key
        and the salt, each in its own field."""
        return {"extra_key": None if scope is None else scope.extra_key,
                "cache_salt": None if scope is None else scope.salt}

    def _running(self) -> Any:
        """The running batch PrefillAdder reserves for: the requests past their prefill."""
        reqs = [live.req for live in self._live.values() if not live.extending]
        return self._batch(reqs, None)

    def _batch(self, reqs: list[Any], chunked: Any) -> Any:
        n = self.n
        return n.ScheduleBatch.init_new(reqs, self.rows, self.alloc, self.tree, self.model,
                                        False, n.NO_SPEC, chunked_req=chunked)

    def _adder(self, chunk: int | None) -> Any:
        return self.n.PrefillAdder(self.block_size, self.tree, self.alloc, self._running(),
                                   0.0, _UNLIMITED, chunk)

    def _schedule(self, req: Any, chunk: int | None) -> Any:
        """PrefillAdder admits `req` (cutting its first chunk at `chunk` tokens) and the
        batch allocates it; the batch, or None when the adder said no."""
        adder = self._adder(chunk)
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        if req not in adder.can_run_list:
            return None
        batch = self._batch([req], req if adder.new_chunked_req is req else None)
        batch.prepare_for_extend()
        return batch

    def _row(self, req: Any, end: int) -> list[int]:
        return [int(x) for x in self.rows.req_to_token[self._row_index(req), :end].tolist()]

    def _pages(self, slots: Sequence[int]) -> list[int]:
        return [x // self.block_size for x in slots[::self.block_size]]

    def _evict_tokens(self, num_tokens: int) -> int:
        """The tree's own evict (an `EvictParams` from 0.5.9, the token count before);
        returns the slots it freed."""
        before = self.full.available_size()
        if self.s.EvictParams is None:
            self.tree.evict(num_tokens)
        else:
            self.tree.evict(self.s.EvictParams(num_tokens=num_tokens))
        return self.full.available_size() - before

    def _write(self, event: dict[str, Any]) -> None:
        if self.record:
            self._log.append(event)

    # -- the protocol ------------------------------------------------------------------------

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        """`Req`, matched; `PrefillAdder` admits it, cutting its first chunk at
        `first_chunk` tokens or else the budget; `prepare_for_extend` allocates.
        A preempted sequence admitted again with its tokens so far resumes as the same
        Req, as SGLang requeues a retracted one."""
        if seq_id in self._live:
            raise ValueError(f"admit({seq_id!r}): already live")
        tokens = list(tokens)
        resumed = self._retracted.pop(seq_id, None)
        req = resumed
        if req is None or list(req.origin_input_ids) + list(req.output_ids) != tokens:
            req = self._new_req(seq_id, tokens, scope)
        req.init_next_round_input(self.tree)
        # a server's chunk size is at least a page; a smaller one schedules nothing
        chunk = self.chunk_budget if first_chunk is None \
            else max(first_chunk, self.block_size)
        batch = self._schedule(req, chunk)
        if batch is None:
            self._refused(req)
            if resumed is not None:
                self._retracted[seq_id] = resumed
            return None
        live = LiveRequest(req, batch, scope, len(tokens))
        end = self._extend_end(req)
        live.ids = self._pages(self._row(req, end))
        self._live[seq_id] = live
        self._write({"kind": "admit", "seq_id": seq_id, "tokens": tokens,
                     "num_tokens": self._prefix_len(req),
                     "scope": self._contract.scope_key(scope), "block_ids": live.ids})
        return Admission(self._prefix_len(req), tuple(live.ids), end)

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """The next chunk, as the scheduler continues a chunked request:
        `init_next_round_input`, `add_chunked_req` (up to `num_tokens`, at most the
        budget), `prepare_for_extend`; None (nothing
        changed but evictions) when its pages cannot be allocated."""
        live = self._live[seq_id]
        req = live.req
        target = min(num_tokens, live.length)
        if target <= self._extend_end(req):
            return self._extend_end(req)
        assert not live.extending, "Session schedules a chunk only after the last one"
        req.init_next_round_input()
        adder = self._adder(min(target - self._prefix_len(req), self.chunk_budget or target))
        chunked = adder.add_chunked_req(req)
        batch = self._batch([req], chunked)
        try:
            batch.prepare_for_extend()
        except RuntimeError as exc:
            if "out of memory" not in str(exc):
                raise
            self._unschedule(req)  # the chunk was not scheduled
            return None
        live.batch, live.extending = batch, True
        before = len(live.ids)
        live.ids = self._pages(self._row(req, self._extend_end(req)))
        if len(live.ids) > before:
            self._write({"kind": "append", "seq_id": seq_id, "tokens": [],
                         "block_ids": live.ids[before:]})
        return int(self._extend_end(req))

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """The forward pass is done up to `num_tokens`; when that is every scheduled
        token of an extend, the result processor's `checkpoint_kv_cache` publishes it;
        when it is a decode step's token, `_decode_result` processes that step."""
        live = self._live[seq_id]
        req = live.req
        scheduled = self._kv_field(req, "kv_allocated_len")
        if num_tokens > scheduled:
            raise ValueError(f"commit({seq_id!r}, {num_tokens}): only "
                             f"{scheduled} tokens were scheduled")
        live.committed = max(live.committed, num_tokens)
        if live.decoding and num_tokens == live.length:
            self._decode_result(live)
        end = self._extend_end(req)
        if not live.extending or num_tokens < end:
            return
        live.extending = False
        self._checkpoint(req, last=end == live.length)
        self._log_commit(seq_id, live, end, self._row(req, end))

    def _log_commit(self, seq_id: Hashable, live: LiveRequest, num_tokens: int,
                    row: list[int]) -> None:
        event: dict[str, Any] = {"kind": "commit", "seq_id": seq_id, "num_tokens": num_tokens}
        ids = self._pages(row)
        if ids != live.ids[:len(ids)]:  # the checkpoint took the tree's copies
            live.ids[:len(ids)] = ids
            event["block_ids"] = list(live.ids)
        self._write(event)

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        """A decode step: the token joins `Req.output_ids`, `check_decode_mem` (which may
        evict) then `prepare_for_decode` allocates its slot; None if there is no room."""
        live = self._live[seq_id]
        req, batch = live.req, live.batch
        (token,) = tokens
        req.output_ids.append(token)
        if not batch.check_decode_mem():
            req.output_ids.pop()
            return None
        self._prepare_decode(batch)
        live.length += 1
        live.decoding = True
        before = len(live.ids)
        live.ids = self._pages(self._row(req, self._kv_field(req, "kv_allocated_len")))
        added = live.ids[before:]
        self._write({"kind": "append", "seq_id": seq_id, "tokens": [token],
                     "block_ids": added})
        return tuple(added)

    def free(self, seq_id: Hashable) -> None:
        """A request every token of which is computed finishes:
        `release_kv_cache(checkpoint=True)` inserts it, decoded tokens too; one freed
        earlier is aborted: `release_kv_cache(checkpoint=False)`."""
        live = self._live.pop(seq_id)
        req = live.req
        done = live.committed == live.length and not live.extending
        row_index, end = self._row_index(req), self._committed_len(req)
        prefix = self._prefix_len(req)
        if done:
            req.finished_reason = self.n.FINISH_LENGTH(length=len(req.output_ids))
        self._release(req, checkpoint=done)
        if done and end > prefix:
            # the row as release_kv_cache's checkpoint left it (rows are not cleared)
            row = [int(x) for x in self.rows.req_to_token[row_index, :end].tolist()]
            self._log_commit(seq_id, live, end, row)
        self._write({"kind": "free", "seq_id": seq_id})

    def preempt(self, seq_id: Hashable) -> None:
        """SGLang's retraction of one decoding request: `release_req` (its KV released
        without inserting it, then evictions for the requests still decoding)."""
        live = self._live.pop(seq_id)
        others = sum(1 for other in self._live.values() if not other.extending)
        self._retract(live, others)
        self._retracted[seq_id] = live.req
        self._preempted.append(seq_id)
        self._write({"kind": "free", "seq_id": seq_id})

    def stats(self) -> Stats:
        """The tree's gauges (SGLang keeps no prefix-cache counters in it), in tokens."""
        engine: dict[str, int | float] = {
            "evictable_size": self._evictable(),
            "protected_size": self._protected(), "total_size": self._total(),
            "available_size": self.full.available_size(), **self._gauges()}
        return Stats(engine, self._harness_stats())

    def used_blocks(self) -> int:
        """Pages neither free in SGLang's allocator nor evictable in its tree."""
        P = self.block_size
        return self.num_blocks - self.full.available_size() // P \
            - self._evictable() // P

    def _held(self) -> list[int]:
        """The pages live requests hold outside the tree (their rows past the tree's
        part), with repeats."""
        held: list[int] = []
        for live in self._live.values():
            held += self._pages(self._row(live.req, self._kv_field(
                live.req, "kv_allocated_len"))[self._protected_len(live.req):])
        return held

    def check_integrity(self) -> list[str]:
        """Every page is free, in the tree or held by one live request, never two of
        them; no page is free twice; the tree's gauges add up."""
        free_list = [int(p) for p in self._free_pages().tolist()]
        out = page_problems(self._held(), free_list, self._tree_pages(), self.num_blocks,
                            "requests")
        out += self._problems()
        if self._evictable() + self._protected() != self._total():
            out.append(f"evictable {self._evictable()} + protected {self._protected()} "
                       f"!= total {self._total()}")
        return out

    def _tree_pages(self) -> set[int]:
        """The pages the tree holds: RadixCache's nodes walked (its all_values_flatten
        fails on an empty tree), UnifiedRadixCache's all_values_flatten (its tree core
        is compiled)."""
        P = self.block_size
        if self.tree_kind == "unified":
            return {int(x) // P for x in self.tree.all_values_flatten().tolist()}
        return radix_tree_pages(self.tree, P)

    def leak_report(self) -> list[str]:
        """With nothing live: tokens still locked in the tree, request rows still held."""
        out = []
        if self._protected():
            out.append(f"protected_size {self._protected()}: tokens locked with "
                       "no live request")
        rows = self.rows.available_size()
        if rows != MAX_REQUESTS:
            out.append(f"{MAX_REQUESTS - rows} request rows held with no live request")
        return out


@dataclass(frozen=True)
class _TextConfig:
    """The HF text config field a Mamba batch reads (`schedule_batch.py:3142-3144`): the
    model's state chunk, here the cache's state block."""

    mamba_chunk_size: int


@dataclass(frozen=True)
class _ModelShape:
    """The ModelConfig fields a ScheduleBatch reads (REPLICATED lists it)."""

    vocab_size: int
    is_encoder_decoder: bool
    hf_text_config: _TextConfig
    is_matryoshka: bool = False  # 0.5.12's prepare_for_extend asks (an embedding model's)

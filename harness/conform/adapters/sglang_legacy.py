"""SGLang's own scheduler code before 0.5.22 driving its RadixCache, or on the
`sglang_unified` engine UnifiedRadixCache's full-attention component (0.5.6 to 0.5.21:
`release_kv_cache` and `release_req`, no `checkpoint_kv_cache`), behind the protocol:
`LegacyScheduled`, `SglangScheduled` with each release's Req fields and result
processor (runs in an SGLang venv). `READ` lists the releases read.

What differs from 0.5.22's path, each read from those releases' code (the hooks test
for the feature, not the version, but for the admission reserve):

- a Req keeps its computed prefix as `prefix_indices` and its scheduled extend as
  `extend_range` (0.5.16 on), `fill_len` (0.5.13-0.5.14) or the length of `fill_ids`
  (before: the Req's tokens are lists, `origin_input_ids: List[int]`); its row and
  lengths (`req_pool_idx`, `kv_committed_len`, `kv_allocated_len`,
  `cache_protected_len`) are on itself, on its `ReqKvInfo` (`req.kv`, as in 0.5.22)
  where that declares them (all from 0.5.19);
- after an extend the result processor calls the tree's `cache_unfinished_req`
  (through `maybe_cache_unfinished_req` from 0.5.12: `chunked=True` from
  `Scheduler.stash_chunked_request` after a middle chunk, without from
  `process_batch_result_prefill` after the last); to 0.5.8 the scheduler also frees a
  chunked request's row there, and its next chunk's allocation takes a new one
  (`_stash_frees_row`; a request freed between its chunks first takes that row, as
  the chunk SGLang still runs for it would: `STASH_REPLICATED`);
- a request ends with `release_kv_cache(req, tree, is_insert)`, which inserts through
  the tree's `cache_finished_req` (to 0.5.20) or `insert_req` (0.5.21); a retraction is
  `release_req`, a function from 0.5.13 (taking the published `ServerArgs` in
  0.5.13-0.5.18) and a method of the request's batch before;
- the runtime config is published by `runtime_context.publish` from 0.5.17, by the
  server's `set_global_server_args_for_scheduler` before (`sglang_scheduler`);
- before 0.5.18 a Req has no `cache_salt`: the salt travels as its extra key;
- before 0.5.13 `prepare_for_decode` reads the step's sampled tokens from the batch's
  `output_ids` (`Scheduler.run_batch` sets them); before 0.5.12 PrefillAdder keeps no
  page beyond the prompt (`contract`);
- there is no table of LoRA names (the events name no LoRA);
- `PagedTokenToKVPoolAllocator.alloc_extend` and `alloc_decode` launch triton kernels
  on every device (0.5.22 has CPU paths), and triton has no CPU driver: the two
  launches run in torch (`install_torch_kernels`), the extend's through SGLang's own
  `alloc_extend_naive` (its torch twin of `alloc_extend_kernel`, the NPU allocator's;
  0.5.6-0.5.8 have none, and there the kernel's rule runs, `extend_slots_rule`), the
  decode's as `alloc_decode_kernel` computes it; the methods around them (the page
  count, the refusal, the free list, the eviction) are SGLang's;
- before 0.5.9 the tree's `evict` takes the token count, not an `EvictParams`.

UnifiedRadixCache's other components and its host tier are opened by
`sglang_legacy_unified`, this class's hooks before 0.5.22's adapter of each. On the
`sglang` engine a window is `sglang_swa.SwaCache` (`sglang.load_sglang` says when), a host tier
their HiRadixCache (`sglang_hicache.HiRadixScheduled` over this class) and a Mamba
state their MambaRadixCache where the server builds it
(`sglang_mamba_radix.MambaRadixScheduled`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any

from harness.conform.adapters.sglang_scheduler import (
    PROCESSOR_CITATIONS,
    REPLICATED,
    LiveRequest,
    SglangScheduled,
    source_text,
)
from harness.conform.protocol import Contract, Scope
from harness.conform.versions import parse_version

# the releases whose scheduler code this module was read against (`sglang.load_sglang`
# drives no other's: each release before 0.5.22 renames a Req field or a call)
READ = ("0.5.6", "0.5.6.post1", "0.5.6.post2", "0.5.7", "0.5.8", "0.5.8.post1", "0.5.9",
        "0.5.10", "0.5.10.post1", "0.5.12", "0.5.12.post1", "0.5.13",
        "0.5.13.post1", "0.5.14", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21")
# (the contract's field, where these releases' code settles it), in place of 0.5.22's citations
CITATIONS: tuple[tuple[str, str], ...] = (
    ("matchable_at", "mem_cache/common.py maybe_cache_unfinished_req (the tree's "
                     "cache_unfinished_req) after an extend (batch_result_processor.py "
                     "process_batch_result_prefill, Scheduler.stash_chunked_request); "
                     "release_kv_cache(is_insert=True) (the tree's cache_finished_req, "
                     "0.5.21 insert_req) inserts the decoded tokens when the request "
                     "ends"),
    ("preemption", "schedule_batch.py release_req: release_kv_cache(is_insert=False) "
                   "('TODO (csy): for preempted requests, we may want to insert into the "
                   "tree'), then evict_from_tree_cache for the remaining requests"))

# the first release whose PrefillAdder keeps a page beyond the prompt (0.5.11 has no lock)
PAGE_RESERVED = "0.5.12"
RESERVE_CITATION = (
    "admission_reserve", "schedule_policy.py PrefillAdder.add_one_req (0.5.10): "
    "total_tokens = extend_input_len + the clipped new tokens, refused when >= "
    "rem_total_tokens (free plus evictable); 0.5.12 adds page_size ('Reserve page_size "
    "for page-alignment overhead')")

# what stays replicated beyond 0.5.22's (`sglang_scheduler.REPLICATED`)
KERNELS_REPLICATED = (
    "the slots of an extend and of a decode step in the request's pages and new free "
    "pages: alloc_extend_naive (SGLang's torch twin; before 0.5.9 alloc_extend_kernel's "
    "rule in torch) and alloc_decode_kernel's rule in torch",
    "PagedTokenToKVPoolAllocator.alloc_extend / alloc_decode "
    "(alloc_extend_kernel, alloc_decode_kernel)",
    "triton kernels, and triton has no CPU driver")
# to 0.5.8, what the adapter does for a chunked request freed between its chunks
STASH_REPLICATED = (
    "a chunked request freed (or preempted) between its chunks, its row freed by the "
    "stash, first takes a row with its computed prefix written in it, then is released",
    "Scheduler.abort_request (0.5.8: a running request is marked to_finish and released "
    "after one more forward pass) -> the next chunk's alloc_for_extend (alloc_req_slots, "
    "write_cache_indices)",
    "the protocol's free ends the request at once; SGLang would compute one more chunk "
    "first")
STASH_UNTIL = "0.5.9"  # the first release whose chunked request keeps its row
# 0.5.22's, an aborted request's release in 0.5.18's words (`is_insert`)
LEGACY_REPLICATED: tuple[tuple[str, str, str], ...] = (
    *((what.replace("checkpoint=False", "is_insert=False"), where, why)
      for what, where, why in REPLICATED), KERNELS_REPLICATED)


def contract(terms: Contract) -> Contract:
    """`terms` (0.5.22's scheduler contract, `sglang_options.contract`) as these
    releases' code makes it: their result processor's citations (`CITATIONS`),
    `LEGACY_REPLICATED` in place of 0.5.22's `REPLICATED` (the options' own entries kept;
    before 0.5.9 also `STASH_REPLICATED`), and before 0.5.12 an admission that keeps no page beyond its
    prompt (`RESERVE_CITATION`)."""
    citations = (*(c for c in terms.citations if c not in PROCESSOR_CITATIONS), *CITATIONS)
    reserve = terms.admission_reserve
    if parse_version(terms.version).key < parse_version(PAGE_RESERVED).key:
        reserve, citations = 1, (*citations, RESERVE_CITATION)
    # the options' own entries (a host tier's, a Mamba state's) stay
    replicated = (*LEGACY_REPLICATED, *(r for r in terms.replicated if r not in REPLICATED))
    if parse_version(terms.version).key < parse_version(STASH_UNTIL).key:
        replicated = (*replicated, STASH_REPLICATED)
    return replace(terms, citations=citations, replicated=replicated,
                   admission_reserve=reserve)


class TorchLaunch:
    """A triton kernel's launch, `kernel[grid](*args)`, done in torch by `run(*args)`."""

    def __init__(self, run: Callable[..., None]) -> None:
        self.run = run

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self.run


def extend_slots(naive: Callable[..., None]) -> Callable[..., None]:
    """`alloc_extend_kernel`'s launch through SGLang's `alloc_extend_naive`: the slots
    of each request's extend written to `out_indices`; nothing written when the free
    pages are short (`alloc_extend` then returns None without reading them)."""

    def run(prefix_lens: Any, seq_lens: Any, last_loc: Any, free_pages: Any,
            out_indices: Any, bs_upper: int, page_size: int, *sizing: int) -> None:
        # sizing: 0.5.9's launch also passes max_num_extend_tokens, a triton block size
        new = (seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) \
            // page_size
        if int(new.sum()) <= len(free_pages):
            naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size,
                  out_indices.device)
    return run


def extend_slots_rule(torch: Any) -> Callable[..., None]:
    """`alloc_extend_kernel`'s launch in torch where the release has no torch twin of it
    (0.5.6-0.5.8: no `alloc_extend_naive`), as the kernel computes it
    (`mem_cache/allocator.py:175-250` in 0.5.8): request by request, in batch order,
    from its slot in the output (the extend lengths before it), the rest of its last
    partial page (`last_loc + 1` on), then its new pages, taken from `free_pages` after
    those of the requests before it, slot by slot. Nothing written when the free pages
    are short (`alloc_extend` then returns None without reading them)."""

    def run(prefix_lens: Any, seq_lens: Any, last_loc: Any, free_pages: Any,
            out_indices: Any, bs_upper: int, page_size: int, *sizing: int) -> None:
        P = page_size
        pre, seq, last = prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist()
        new = [-(-s // P) + (p // -P) for p, s in zip(pre, seq, strict=True)]
        if sum(new) > len(free_pages):
            return
        free, out, taken = free_pages.tolist(), [], 0
        for p, s, loc, pages in zip(pre, seq, last, new, strict=True):
            aligned = min(s, -(-p // P) * P)  # the end of the partial page the prefix left
            out += [int(loc) + 1 + k for k in range(aligned - p)]
            out += [int(free[taken + (t - aligned) // P]) * P + t % P for t in range(aligned, s)]
            taken += pages
        out_indices.copy_(torch.tensor(out, dtype=out_indices.dtype))
    return run


def decode_slots(torch: Any) -> Callable[..., None]:
    """`alloc_decode_kernel`'s launch: a request whose new token (its last, at
    seq_len - 1) starts a page takes the next free page's first slot, in batch order;
    the others the slot after their last (`last_loc + 1`). Nothing written when the
    free pages are short (`alloc_decode` then returns None)."""

    def run(seq_lens: Any, last_loc: Any, free_pages: Any, out_indices: Any,
            bs_upper: int, page_size: int) -> None:
        starts = ((seq_lens - 1) % page_size == 0).to(torch.int64)
        taken = int(starts.sum())
        if taken > len(free_pages):
            return
        out = last_loc.to(torch.int64) + 1
        if taken:
            first = torch.cumsum(starts, 0) - starts
            pages = free_pages[first.clamp(max=len(free_pages) - 1)] * page_size
            out = torch.where(starts.bool(), pages, out)
        out_indices.copy_(out)
    return run


def install_torch_kernels(paged: Any, torch: Any) -> None:
    """Replace the two triton launches of SGLang's `allocator.paged` module (its
    `alloc_extend_kernel` and `alloc_decode_kernel` names) by their torch runs; once
    per process (the module is shared), idempotent."""
    if not isinstance(paged.alloc_extend_kernel, TorchLaunch):
        naive = getattr(paged, "alloc_extend_naive", None)
        paged.alloc_extend_kernel = TorchLaunch(
            extend_slots(naive) if naive is not None else extend_slots_rule(torch))
    if not isinstance(paged.alloc_decode_kernel, TorchLaunch):
        paged.alloc_decode_kernel = TorchLaunch(decode_slots(torch))


class LegacyScheduled(SglangScheduled):
    """`SglangScheduled` over RadixCache (or UnifiedRadixCache's full-attention component)
    on a release with SGLang's scheduler code but no
    `checkpoint_kv_cache` (0.5.6 to 0.5.21): the Req and result-processor hooks as the
    module docstring says."""

    def _kv_pools(self) -> tuple[Any, Any, Any]:
        """0.5.22's pools, their allocator's triton launches run in torch."""
        install_torch_kernels(importlib.import_module(self.n.PagedAllocator.__module__),
                              self.n.torch)
        return super()._kv_pools()

    def _prefix_len(self, req: Any) -> int:
        return len(req.prefix_indices)

    def _extend_end(self, req: Any) -> int:
        """`extend_range`'s end (0.5.16 on), `fill_len` (0.5.13-0.5.14), the length of
        `fill_ids` before."""
        if hasattr(req, "set_extend_range"):
            return int(req.extend_range.end)
        return int(req.fill_len if hasattr(req, "fill_len") else len(req.fill_ids))

    def _unschedule(self, req: Any) -> None:
        prefix = len(req.prefix_indices)
        if hasattr(req, "set_extend_range"):
            req.set_extend_range(prefix, prefix)
            return
        # before 0.5.16 PrefillAdder sets both (schedule_policy.py add_chunked_req)
        if hasattr(req, "fill_len"):
            req.fill_len = prefix
        else:
            req.fill_ids = req.fill_ids[:prefix]
        req.set_extend_input_len(0)

    def _kv_field(self, req: Any, name: str) -> int:
        """On `req`'s `ReqKvInfo` where that declares the field (all four from 0.5.19,
        `kv_allocated_len` from 0.5.16; no `ReqKvInfo` before), else on the Req."""
        info = getattr(self.n.schedule_batch, "ReqKvInfo", None)
        held = req.kv if name in getattr(info, "__annotations__", {}) else req
        return int(getattr(held, name))

    def _insert_call(self) -> str:
        """The tree method `release_kv_cache` inserts through (module docstring)."""
        return "cache_finished_req" if hasattr(self.tree, "cache_finished_req") \
            else "insert_req"

    def _checkpoint(self, req: Any, last: bool) -> None:
        """`maybe_cache_unfinished_req` (0.5.12 on; before, the tree's
        `cache_unfinished_req` straight): chunked after a middle chunk, as the scheduler
        stashes one; where the scheduler also frees the row then (`_stash_frees_row`),
        so does the adapter, and the next chunk's allocation takes a new one."""
        if hasattr(self.n.common, "maybe_cache_unfinished_req"):
            self.n.common.maybe_cache_unfinished_req(req, self.tree, chunked=not last)
        else:
            self.tree.cache_unfinished_req(req, chunked=not last)
        if not last and self._stash_frees_row:
            row = self._row_index(req)
            self.rows.free(row)
            self._stashed[id(req)] = row

    @cached_property
    def _stashed(self) -> dict[int, int]:
        """The requests (by id) whose row the stash freed -> that row, until a chunk's
        allocation gives them a new one or they end (`_restore_row`)."""
        return {}

    def _between_chunks(self, req: Any) -> bool:
        """Whether `req`'s row is the one the stash freed (no chunk's allocation since)."""
        freed = self._stashed.get(id(req))
        return freed is not None and freed == self._row_index(req)

    def _restore_row(self, req: Any) -> None:
        """A request between its chunks, its row freed by the stash, ends (freed or
        preempted): it first takes a row with its computed prefix written in it, as the
        allocation of the chunk SGLang still runs for it does (`alloc_for_extend`'s
        `alloc_req_slots` and `write_cache_indices`; 0.5.8's `abort_request` marks a
        running request `to_finish` and releases it after that chunk), so its release
        frees what it holds once. Nothing for any other request."""
        if not self._between_chunks(req):
            return
        del self._stashed[id(req)]
        row = int(self.rows.alloc(1)[0])
        prefix = req.prefix_indices
        self.rows.write((row, slice(0, len(prefix))), prefix)
        req.req_pool_idx = row

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """The next chunk; where the stash freed the request's row, its allocation takes
        a new one, which a refused chunk gives back (its pages were not allocated)."""
        req = self._live[seq_id].req
        if not self._between_chunks(req):
            return super().reserve(seq_id, num_tokens)
        free = list(self.rows.free_slots)
        out = super().reserve(seq_id, num_tokens)
        if out is None:
            left = set(self.rows.free_slots)
            taken = [x for x in free if x not in left]
            if taken:
                self.rows.free(taken)
        return out

    def _row(self, req: Any, end: int) -> list[int]:
        """A stashed request's computed slots are its `prefix_indices` (its freed row
        may be another request's by now)."""
        if self._between_chunks(req):
            return [int(x) for x in req.prefix_indices[:end].tolist()]
        return super()._row(req, end)

    @cached_property
    def _stash_frees_row(self) -> bool:
        """Whether this release's scheduler frees a chunked request's row after its
        middle chunk ("chunked request keeps its rid but will get a new req_pool_idx":
        `Scheduler.get_next_batch_to_run` in 0.5.6-0.5.7, `stash_chunked_request` in
        0.5.8; from 0.5.9 the request keeps its row), read from its source without
        importing it."""
        source = source_text("sglang.srt.managers.scheduler")
        return any(code in source for code in (
            "self.req_to_token_pool.free(self.chunked_req.req_pool_idx)",
            "self.req_to_token_pool.free(req.req_pool_idx)"))

    def _release(self, req: Any, checkpoint: bool) -> None:
        self._restore_row(req)
        self.n.common.release_kv_cache(req, self.tree, is_insert=checkpoint)

    @cached_property
    def _lists(self) -> bool:
        """Whether this release's Req keeps its tokens in lists (`origin_input_ids:
        List[int]`, before 0.5.13), not arrays."""
        wants = inspect.signature(self.n.Req.__init__).parameters["origin_input_ids"]
        return "List" in str(wants.annotation)

    @cached_property
    def _salted(self) -> bool:
        """Whether this release's Req takes a `cache_salt` beside its extra key (0.5.18
        on)."""
        return "cache_salt" in inspect.signature(self.n.Req.__init__).parameters

    def _input_ids(self, tokens: Sequence[int]) -> Any:
        """An `array('q')` from 0.5.13, a list before (which `init_next_round_input`
        joins to a list of output ids)."""
        return list(tokens) if self._lists else super()._input_ids(tokens)

    def _prepare_decode(self, batch: Any) -> None:
        """Before 0.5.13 `prepare_for_decode` reads the step's sampled tokens from the
        batch's `output_ids`, which `Scheduler.run_batch` sets from the model's output:
        here each request's last output token, the op's."""
        if self._lists:
            batch.output_ids = self.n.torch.tensor(
                [int(r.output_ids[-1]) for r in batch.reqs], dtype=self.n.torch.int64)
        super()._prepare_decode(batch)

    def _scope_keys(self, scope: Scope | None) -> dict[str, Any]:
        """Before 0.5.18 a Req has no `cache_salt`: the salt travels as its extra key
        (the contract's scope kinds then leave the caller's extra key out)."""
        if self._salted:
            return super()._scope_keys(scope)
        return {"extra_key": None if scope is None else scope.salt}

    def _free_pages(self) -> Any:
        """The allocator's free and released pages: its own census from 0.5.20, the two
        lists before."""
        if hasattr(self.full, "get_all_free_pages"):
            return super()._free_pages()
        return self.n.torch.cat((self.full.free_pages, self.full.release_pages))

    def _retract(self, live: LiveRequest, others: int) -> None:
        """`release_req`: a function from 0.5.13, before a method of the request's batch
        (`ScheduleBatch.release_req(idx, remaing_req_count, server_args)`)."""
        self._restore_row(live.req)
        if hasattr(self.n.schedule_batch, "release_req"):
            super()._retract(live, others)
            return
        batch = live.batch
        batch.release_req(batch.reqs.index(live.req), others, self.n.server_args)

    def _retraction_args(self) -> dict[str, Any]:
        """`release_req` (the function, 0.5.13 on) reads the published ServerArgs (its
        disaggregation mode) in 0.5.13-0.5.18; from 0.5.19 it takes none."""
        wants = inspect.signature(self.n.schedule_batch.release_req).parameters
        return {"server_args": self.n.server_args} if "server_args" in wants else {}

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every SGLang function the adapter calls."""
        out = super().engine_callables()
        for gone in ("match_kv_cache", "checkpoint_kv_cache", "checkpoint",
                     "LoRA names .register"):
            del out[gone]
        out.update({
            "cache_unfinished_req": (self.tree, "cache_unfinished_req"),
            self._insert_call(): (self.tree, self._insert_call())})
        if hasattr(self.n.common, "maybe_cache_unfinished_req"):
            out["maybe_cache_unfinished_req"] = (self.n.common, "maybe_cache_unfinished_req")
        if not hasattr(self.n.Req, "_compute_max_prefix_len"):  # inline before 0.5.13
            del out["Req._compute_max_prefix_len"]
        if not hasattr(self.n.schedule_batch, "release_req"):  # `_retract`
            out["release_req"] = (self.n.ScheduleBatch, "release_req")
        return out

    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        """The SGLang functions each op kind calls."""
        out = super().engine_calls()
        out["admit"] = (*(x for x in out["admit"] if x != "match_kv_cache"), "match_prefix")
        out["commit"] = (*(["maybe_cache_unfinished_req"] if hasattr(
            self.n.common, "maybe_cache_unfinished_req") else []), "cache_unfinished_req")
        out["free"] = ("release_kv_cache", self._insert_call())
        return out

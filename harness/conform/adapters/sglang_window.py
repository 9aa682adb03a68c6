"""SGLang's own scheduler code over a FULL+SWA `UnifiedRadixCache` (0.5.22 on, and
0.5.19-0.5.21 under their older code: `sglang_legacy_unified`; runs in an SGLang venv):
`WindowScheduled`, `sglang_scheduler.SglangScheduled` opened with a window, over SGLang's
default pools of a hybrid sliding-window model (`SWAKVPool`: layer 0 full attention,
layer 1 the window; `SWATokenToKVPoolAllocator`: a full and a window pool, each paged,
the window pool as large as the full one unless `Contract.window_pool` sizes it as a
server's `--swa-full-tokens-ratio` does: `window_pool_tokens`). Its rules, each release's
at its own lines, are `window_rules` (the window's, and the window pool's). The scheduler
frees the window KV itself (`ScheduleBatch.maybe_evict_swa`, and the tree's insert), so
nothing of it is replicated here.

On the `sglang` engine before 0.5.22 a window is `SWARadixCache`'s with the adapter as
its caller: `sglang_swa`.
"""

from __future__ import annotations

import inspect
from typing import Any

from harness.conform.adapters.sglang_scheduler import SglangScheduled

# SGLang's window rule, each part where its own code says so: the contract's `window`
# citation. `_WINDOW` is its text with each release's lines (`WINDOW_LINES`): the freeing
# at an insert is SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS's (on by default), in
# checkpoint_into_tree from 0.5.22 and the tree's cache_unfinished_req before; 0.5.23
# frees below pre_len - ceil_align(max(window, page), page), the releases before it below
# pre_len - max(window, page) floored to a page (one page more where the window is not a
# multiple of the page)
_WINDOW = (
    "UnifiedRadixCache(FULL, SWA) over SWAKVPool + SWATokenToKVPoolAllocator, the "
    "default pools of a hybrid sliding-window model (mem_cache/kv_cache_configurator.py "
    "SWATokenToKVPoolAllocator, without --enable-unified-memory): the window group has a "
    "pool of its own as large as the full group's. A running request's window KV is "
    "freed below the window when the request is put into the tree "
    "(SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS, on by default: "
    "mem_cache/unified_radix_cache.py:{insert} {inserter}; the freed positions go into "
    "the tree as tombstones) and at a decode step's allocation "
    "(managers/schedule_batch.py:{gate} maybe_evict_swa: decode_batch_idx >= 1, every "
    "SGLANG_SWA_EVICTION_INTERVAL tokens; an extend frees none there where the tree "
    "shares prefixes, :{extend}), below {bound} (mem_cache/common.py:{free} "
    "free_swa_out_of_window_slots, the bound at :{threshold}), never below what the tree protects for it; what "
    "the tree holds with window KV keeps it, locked for the window and LRU-evictable "
    "below it, where an eviction tombstones an inner node (its full KV stays; "
    "unified_cache/components/{swa}:{evict} evict_component); a match ends only where "
    "the window before it has window KV ({swa}:{validator} create_match_validator)")
_FLOORED = "pre_len - max(window, page), floored to a page"
WINDOW_LINES: dict[str, dict[str, str]] = {
    "0.5.19": dict(insert="966-973", inserter="cache_unfinished_req", gate="3599-3605",
                   extend="3624", bound=_FLOORED, threshold="85", free="54-119",
                   swa="swa_component.py", evict="577-619", validator="287-297"),
    "0.5.20": dict(insert="1141-1148", inserter="cache_unfinished_req", gate="3742-3748",
                   extend="3765", bound=_FLOORED, threshold="86", free="55-108",
                   swa="swa.py", evict="654-696", validator="330-340"),
    "0.5.21": dict(insert="1207-1214", inserter="cache_unfinished_req", gate="3909-3922",
                   extend="3940", bound=_FLOORED, threshold="97", free="55-117",
                   swa="swa.py", evict="651-693", validator="332-342"),
    "0.5.22": dict(insert="1127-1137", inserter="checkpoint_into_tree", gate="3914-3927",
                   extend="3936-3938", bound=_FLOORED, threshold="100", free="58-120",
                   swa="swa.py", evict="679-721", validator="360-370"),
    "0.5.23": dict(insert="1211-1221", inserter="checkpoint_into_tree", gate="4087",
                   extend="4107", bound="pre_len - ceil_align(max(window, page), page)",
                   threshold="116-118",
                   free="100-118", swa="swa.py", evict="694-724", validator="369-375"),
}

# how a smaller window pool is sized and what it does: the contract's `window_pool`
# citation, with each release's lines (`WINDOW_POOL_LINES`)
_WINDOW_POOL = (
    "a server sizes the window pool as swa_tokens = page-aligned int(full_tokens * "
    "swa_full_tokens_ratio) (model_executor/pool_configurator.py:{solve} "
    "_solve_pool_sizes; the ratio defaults to 0.8, {ratio}, and must lie in (0, 1], "
    "arg_groups/kv_cache_hook.py:{range}) and refuses a pool with sliding_window_size "
    "+ page_size >= swa_tokens (pool_configurator.py:{validate}); an allocation that "
    "finds the window pool short evicts window KV from the tree, tombstoning an inner "
    "node (full KV kept, unified_cache/components/{swa}:{evict} evict_component), and a "
    "later match ends before a node the window before which lacks window KV "
    "({swa}:{validator} create_match_validator)")
WINDOW_POOL_LINES: dict[str, dict[str, str]] = {
    "0.5.19": dict(solve="605-606", ratio="server_args.py:818-830", range="192-193",
                   validate="608-617, inline in _solve_pool_sizes"),
    "0.5.20": dict(solve="760-761", ratio="arg_groups/fields/schedule.py:152-164",
                   range="193", validate="176-194 validate_swa_pool_size"),
    "0.5.21": dict(solve="768-769", ratio="arg_groups/fields/schedule.py:146-158",
                   range="427", validate="168-186 validate_swa_pool_size"),
    "0.5.22": dict(solve="854-855", ratio="arg_groups/fields/schedule.py:146-158",
                   range="427", validate="195-213 validate_swa_pool_size"),
    "0.5.23": dict(solve="879-881", ratio="arg_groups/fields/schedule.py:150-161",
                   range="427", validate="198-216 validate_swa_pool_size"),
}


def window_rules(version: str) -> tuple[str, str]:
    """The window rule and the window pool's rule of `version` at its own lines (a
    release of `WINDOW_LINES`), else the newest's."""
    lines = WINDOW_LINES.get(version, WINDOW_LINES["0.5.23"])
    pool = WINDOW_POOL_LINES.get(version, WINDOW_POOL_LINES["0.5.23"])
    return (_WINDOW.format(**lines),
            _WINDOW_POOL.format(**pool, **{k: lines[k] for k in ("swa", "evict", "validator")}))


def window_pool_tokens(pages: int | None, num_blocks: int, block_size: int,
                       window: int) -> int:
    """The window pool's size in tokens for a full pool of `num_blocks` pages of
    `block_size` and a window pool of `pages` (None: as large as the full pool), as a
    server with `--swa-full-tokens-ratio` pages / num_blocks sizes it (`window_rules`, the pool's:
    page-aligned int(full_tokens * ratio) is `pages` pages). Raises ValueError naming
    `pages` where SGLang's server would refuse it (a ratio above 1, or a pool no larger
    than the window plus a page: `validate_swa_pool_size`)."""
    if pages is None:
        return num_blocks * block_size
    if pages > num_blocks:
        raise ValueError(f"CacheOptions.window_pool {pages} is larger than the full pool "
                         f"({num_blocks} blocks): SGLang's swa_full_tokens_ratio must lie in "
                         "(0, 1]")
    tokens = pages * block_size
    if window + block_size >= tokens:
        raise ValueError(f"CacheOptions.window_pool {pages} ({tokens} tokens) cannot hold one "
                         f"request: SGLang refuses a window pool of at most the window "
                         f"({window}) plus a page ({block_size})")
    return tokens


class WindowScheduled(SglangScheduled):
    """`SglangScheduled` over a UnifiedRadixCache with its SWA component too (window
    `contract.window` tokens), over SGLang's SWA pools and the request pool of the
    plain path (or, with a Mamba component too, the Mamba one:
    `sglang_mamba.WindowMambaScheduled`)."""

    def _kv_pools(self) -> tuple[Any, Any, Any]:
        """(SWAKVPool, SWATokenToKVPoolAllocator over it, its full-attention allocator):
        layer 0 full attention, layer 1 the window, a pool each (kv_cache_configurator.py
        _build_hybrid_swa_kv_pool), the window pool `window_pool_tokens` large. Raises
        ValueError naming a window pool SGLang's server would refuse."""
        n, P = self.n, self.block_size
        assert n.swa is not None and self.tree_kind == "unified", "no SWA tree here"
        pool, allocator, _ = n.swa
        size = self.num_blocks * P
        window = self._contract.window
        assert window is not None
        size_swa = window_pool_tokens(self._contract.window_pool, self.num_blocks, P, window)
        kv = pool(size=size, size_swa=size_swa, page_size=P, dtype=n.torch.float16, head_num=1,
                  head_dim=8, swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
                  device="cpu", enable_memory_saver=False)
        # the request pool where the allocator takes it (0.5.20 on; 0.5.19's does not)
        rows = {"req_to_token_pool": self.rows} \
            if "req_to_token_pool" in inspect.signature(allocator).parameters else {}
        alloc = allocator(size, size_swa, page_size=P, dtype=n.torch.float16, device="cpu",
                          kvcache=kv, need_sort=False, **rows)
        return kv, alloc, alloc.full_attn_allocator

    def _components(self) -> tuple[Any, ...]:
        return (*super()._components(), self.n.swa[2])  # type: ignore[index]

    def _tree_params(self) -> dict[str, Any]:
        return {**super()._tree_params(), "sliding_window_size": self._contract.window}

    def _window_gap(self) -> int:
        """Tokens the tree holds full KV of without window KV (its tombstones)."""
        t = self.tree
        return int(t.evictable_size() + t.protected_size()
                   - t.swa_evictable_size() - t.swa_protected_size())

    def _harness_stats(self) -> dict[str, int | float]:
        """Besides the full pool's: windowGapTokens (`_window_gap`)."""
        return {**super()._harness_stats(), "windowGapTokens": self._window_gap()}

    def _gauges(self) -> dict[str, int | float]:
        """Besides the other components': the window pool's and the tree's window gauges
        in SGLang's names (tokens)."""
        return {**super()._gauges(), "swa_available_size": self.alloc.swa_available_size(),
                "swa_evictable_size": self.tree.swa_evictable_size(),
                "swa_protected_size": self.tree.swa_protected_size()}

    def _swa_cursor(self, kv: Any) -> int:
        """A request's SWA eviction cursor (its `ReqKvInfo`'s): the slots below it, from
        `swa_dead_lo` on, SGLang has freed."""
        return int(kv.get_evicted_seqlen(self.n.swa[2]))  # type: ignore[index]

    def _problems(self) -> list[str]:
        """Besides the other components': the window pool's pages in use are the tree's
        window pages (evictable and protected) and those live requests hold of their
        own: their rows past what they checkpointed, less what SGLang freed below the
        window ([swa_dead_lo, the request's SWA eviction cursor))."""
        P = self.block_size
        held = 0
        for live in self._live.values():
            kv = live.req.kv
            lo, hi = kv.swa_dead_lo(P), self._swa_cursor(kv)
            row = self._row(live.req, kv.kv_allocated_len)
            held += len({row[i] // P for i in range(kv.cache_protected_len, len(row))
                         if not lo <= i < hi})
        size = window_pool_tokens(self._contract.window_pool, self.num_blocks, P,
                                  self._contract.window or 0) // P
        used = size - self.alloc.swa_available_size() // P
        tree = (self.tree.swa_evictable_size() + self.tree.swa_protected_size()) // P
        out = super()._problems()
        if used != tree + held:
            out.append(f"window pool: {used} pages in use, but the tree holds {tree} and "
                       f"live requests {held} of their own")
        return out

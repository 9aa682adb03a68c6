"""SGLang's own scheduler code over a FULL+SWA `UnifiedRadixCache` (0.5.23 on; runs in an
SGLang venv): `WindowScheduled`, `sglang_scheduler.SglangScheduled` opened with a window,
over SGLang's default pools of a hybrid sliding-window model (`SWAKVPool`: layer 0 full
attention, layer 1 the window; `SWATokenToKVPoolAllocator`: a full and a window pool,
each paged, the window pool as large as the full one unless `Contract.window_pool` sizes
it as a server's `--swa-full-tokens-ratio` does: `window_pool_tokens`), its rule
`WINDOW_RULE` (and `WINDOW_POOL_RULE` for a smaller window pool). The scheduler frees the window KV
itself (`ScheduleBatch.maybe_evict_swa`), so nothing of it is replicated here.

Before 0.5.22, where SGLang's scheduler code does not run here, a window is
`SWARadixCache`'s with the adapter as its caller: `sglang_swa`.
"""

from __future__ import annotations

from typing import Any

from harness.conform.adapters.sglang_scheduler import SglangScheduled

# SGLang's window rule (0.5.23), each part where its own code says so; the contract's
# `window` citation
WINDOW_RULE = (
    "UnifiedRadixCache(FULL, SWA) over SWAKVPool + SWATokenToKVPoolAllocator, the "
    "default pools of a hybrid sliding-window model (mem_cache/kv_cache_configurator.py "
    "SWATokenToKVPoolAllocator, without --enable-unified-memory): the window group has a "
    "pool of its own as large as the full group's. A running request frees its own "
    "slots' window KV only at a decode step's allocation (managers/schedule_batch.py:4087 "
    "maybe_evict_swa: decode_batch_idx >= 1; an extend frees none where the tree shares "
    "prefixes, :4107), below seqlen - ceil(max(window, page)) pages, never below what it "
    "checkpointed into the tree (mem_cache/common.py:100-118 free_swa_out_of_window_slots); "
    "what is in the tree keeps its window KV, locked for the window and LRU-evictable "
    "below it, where an eviction tombstones an inner node (its full KV stays; "
    "unified_cache/components/swa.py:694-724 evict_component); a match ends only where "
    "the window before it has window KV (swa.py:369-375 create_match_validator)")
# how a smaller window pool is sized and what it does (0.5.23); the contract's
# `window_pool` citation
WINDOW_POOL_RULE = (
    "a server sizes the window pool as swa_tokens = page-aligned int(full_tokens * "
    "swa_full_tokens_ratio) (model_executor/pool_configurator.py:879-881 _solve_pool_sizes; "
    "the ratio defaults to 0.8, arg_groups/fields/schedule.py:150-161, and must lie in "
    "(0, 1], arg_groups/kv_cache_hook.py:427) and refuses a pool with sliding_window_size "
    "+ page_size >= swa_tokens (pool_configurator.py:198-216 validate_swa_pool_size); an "
    "allocation that finds the window pool short evicts window KV from the tree, "
    "tombstoning an inner node (full KV kept, unified_cache/components/swa.py:694-724 "
    "evict_component), and a later match ends before a node the window before which "
    "lacks window KV (swa.py:369-375 create_match_validator)")


def window_pool_tokens(pages: int | None, num_blocks: int, block_size: int,
                       window: int) -> int:
    """The window pool's size in tokens for a full pool of `num_blocks` pages of
    `block_size` and a window pool of `pages` (None: as large as the full pool), as a
    server with `--swa-full-tokens-ratio` pages / num_blocks sizes it (`WINDOW_POOL_RULE`:
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
        alloc = allocator(size, size_swa, page_size=P, dtype=n.torch.float16, device="cpu",
                          kvcache=kv, need_sort=False, req_to_token_pool=self.rows)
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

    def _problems(self) -> list[str]:
        """Besides the other components': the window pool's pages in use are the tree's
        window pages (evictable and protected) and those live requests hold of their
        own: their rows past what they checkpointed, less what SGLang freed below the
        window ([swa_dead_lo, the request's SWA eviction cursor))."""
        P, swa = self.block_size, self.n.swa[2]  # type: ignore[index]
        held = 0
        for live in self._live.values():
            kv = live.req.kv
            lo, hi = kv.swa_dead_lo(P), kv.get_evicted_seqlen(swa)
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

"""SGLang's own scheduler code over a FULL+SWA `UnifiedRadixCache` (0.5.23 on; runs in an
SGLang venv): `WindowScheduled`, `sglang_scheduler.SglangScheduled` opened with a window,
over SGLang's default pools of a hybrid sliding-window model (`SWAKVPool`: layer 0 full
attention, layer 1 the window; `SWATokenToKVPoolAllocator`: a full and a window pool of
equal sizes, each paged), its rule `WINDOW_RULE`. The scheduler frees the window KV
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


class WindowScheduled(SglangScheduled):
    """`SglangScheduled` over a UnifiedRadixCache with its SWA component too (window
    `contract.window` tokens), over SGLang's SWA pools and the request pool of the
    plain path (or, with a Mamba component too, the Mamba one:
    `sglang_mamba.WindowMambaScheduled`)."""

    def _kv_pools(self) -> tuple[Any, Any, Any]:
        """(SWAKVPool, SWATokenToKVPoolAllocator over it, its full-attention allocator):
        layer 0 full attention, layer 1 the window, a pool each of equal sizes (as
        SGLang's server pools a hybrid model by default, kv_cache_configurator.py
        _build_hybrid_swa_kv_pool)."""
        n, P = self.n, self.block_size
        assert n.swa is not None and self.tree_kind == "unified", "no SWA tree here"
        pool, allocator, _ = n.swa
        size = self.num_blocks * P
        kv = pool(size=size, size_swa=size, page_size=P, dtype=n.torch.float16, head_num=1,
                  head_dim=8, swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
                  device="cpu", enable_memory_saver=False)
        alloc = allocator(size, size, page_size=P, dtype=n.torch.float16, device="cpu",
                          kvcache=kv, need_sort=False, req_to_token_pool=self.rows)
        return kv, alloc, alloc.full_attn_allocator

    def _components(self) -> tuple[Any, ...]:
        return (*super()._components(), self.n.swa[2])  # type: ignore[index]

    def _tree_params(self) -> dict[str, Any]:
        return {**super()._tree_params(), "sliding_window_size": self._contract.window}

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
        used = self.num_blocks - self.alloc.swa_available_size() // P
        tree = (self.tree.swa_evictable_size() + self.tree.swa_protected_size()) // P
        out = super()._problems()
        if used != tree + held:
            out.append(f"window pool: {used} pages in use, but the tree holds {tree} and "
                       f"live requests {held} of their own")
        return out

"""SGLang's `MambaRadixCache`, the tree its server builds for a hybrid Mamba model up to
0.5.14, under the release's own scheduler code: `MambaRadixScheduled`, the Mamba hooks
of `sglang_mamba.MambaScheduled` over the legacy Req and result processor of
`sglang_legacy.LegacyScheduled` (runs in an SGLang venv).

The pools are the ones `MambaScheduled` builds (SGLang's `HybridReqToTokenPool` with
its `MambaPool`, `HybridLinearKVPool`, the extra buffer on); the tree is
`MambaRadixCache(CacheInitParams(..., enable_mamba_extra_buffer=True))`, as the
server's `mem_cache/registry.py` builds it. What the tree's callers do with a Mamba
state (the slot its match copies, the ping-pong track slots, checkpointing up to the
last tracked state, a finished request donating its state) is the release's own code:
`Req.init_next_round_input`, `ScheduleBatch.prepare_for_extend` and
`prepare_for_decode`, the tree's `cache_unfinished_req` and `cache_finished_req`,
`release_kv_cache`, and the result processor's decode-state bookkeeping
(`sglang_mamba.track_decode_state`).

Opened on 0.5.13-0.5.14 only (`sglang_scheduler.SchedulerNames.mamba_radix` says why
not elsewhere): before 0.5.13 the state grid is the FLA kernel's chunk (64 tokens, no
option moves it), and from 0.5.16 the server builds UnifiedRadixCache's MAMBA component
instead, so MambaRadixCache there is a module no server runs.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

from harness.conform.adapters import sglang_mamba
from harness.conform.adapters.sglang_legacy import LegacyScheduled, install_torch_kernels
from harness.conform.adapters.sglang_mamba import MambaScheduled

# MambaRadixCache's snapshot rule (0.5.14, extra buffer), each part where its own code
# says so: the contract's `state_interval` citation (its `state_rule` "extend-end", as
# UnifiedRadixCache's MAMBA component keeps it: `sglang_mamba.mamba_rule`)
MAMBA_RADIX_RULE = (
    "MambaRadixCache(enable_mamba_extra_buffer) over HybridReqToTokenPool + "
    "HybridLinearKVPool (0.5.14; mem_cache/registry.py:119-122 builds it for a hybrid "
    "SSM model, the scheduler's init_cache before 0.5.13): states lie on the grid "
    "g = mamba_cache_chunk_size = max(the model's chunk, page) (server_args.py:6617-6630); "
    "an extend keeps one, at prefix_len + floor(extend_len / g) * g, none when shorter "
    "than g (managers/schedule_batch.py:2286, :2301-2305 "
    "_mamba_radix_cache_v2_req_prepare_for_extend), or the branching point its match "
    "named when that lies inside it on its grid (mamba_radix_cache.py:1099-1109, "
    "schedule_batch.py:2330-2344); cache_unfinished_req and cache_finished_req insert "
    "the full KV only up to that last tracked state (mamba_radix_cache.py:636-641, "
    ":533-538), a decode step tracks one every mamba_track_interval tokens "
    "(batch_result_processor.py _mamba_prefix_cache_update); a match ends on the deepest "
    "node with a state (mamba_radix_cache.py:1022-1060 best_value_len, :1125)")

# the contract's `replicated` entry for `sglang_mamba.unpinned` on these releases
PIN_STUB = (
    sglang_mamba.PIN_STUB[0],
    "managers/schedule_batch.py ScheduleBatch.prepare_for_decode (0.5.14: :1593-1597 "
    "set_mamba_track_indices_from_reqs, :2680): the Mamba track indices built "
    "page-locked and the track mask page-locked before their copies to the device",
    sglang_mamba.PIN_STUB[2])


class MambaRadixScheduled(MambaScheduled, LegacyScheduled):
    """`MambaScheduled`'s pools and steps over a `MambaRadixCache` under a release's
    legacy scheduler code (`LegacyScheduled`'s hooks for everything else)."""

    @property
    def _mamba(self) -> tuple[Any, ...]:
        """`SchedulerNames.mamba_radix`: the pools, MambaRadixCache, the result
        processor."""
        assert self.n.mamba_radix is not None, "no MambaRadixCache here"
        return cast(tuple[Any, ...], self.n.mamba_radix)

    def _kv_pools(self) -> tuple[Any, Any, Any]:
        """`MambaScheduled`'s pools, their allocator's triton launches run in torch (as
        `LegacyScheduled._kv_pools` runs them)."""
        install_torch_kernels(importlib.import_module(self.n.PagedAllocator.__module__),
                              self.n.torch)
        return MambaScheduled._kv_pools(self)

    def _build_tree(self) -> Any:
        return self._mamba[4](self.n.CacheInitParams(**self._cache_params(),
                                                     enable_mamba_extra_buffer=True))

    def _evictable(self) -> int:
        """`full_evictable_size` (MambaRadixCache's `evictable_size` raises: "use
        full_evictable_size() and mamba_evictable_size() instead")."""
        return int(self.tree.full_evictable_size())

    def _protected(self) -> int:
        return int(self.tree.full_protected_size())

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every SGLang function the adapter calls."""
        out = super().engine_callables()
        del out["evictable_size"], out["protected_size"]
        t = self.tree
        out.update({"full_evictable_size": (t, "full_evictable_size"),
                    "full_protected_size": (t, "full_protected_size"),
                    "all_mamba_values_flatten": (t, "all_mamba_values_flatten")})
        out["MambaRadixCache.__init__"] = (self._mamba[4], "__init__")
        return out

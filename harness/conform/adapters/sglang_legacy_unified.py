"""UnifiedRadixCache's other components and its host tier under SGLang's scheduler code
before 0.5.22 (`sglang_unified` 0.5.19-0.5.21, the tree those releases' servers build for
every model; runs in an SGLang venv).

Each class is 0.5.22's adapter for the component (`sglang_window.WindowScheduled`, the
SWA pools; `sglang_mamba.MambaScheduled`, the Mamba pools and the result processor's
decode-state bookkeeping; `sglang_mamba.WindowMambaScheduled`, both;
`sglang_hicache.HostScheduled`, `init_hicache` and each op as a HiCache step) with
`sglang_legacy.LegacyScheduled`'s hooks for what those releases' scheduler code does
otherwise: the Req's fields, the tree's `cache_unfinished_req` after an extend,
`release_kv_cache` at the end, `release_req` on a retraction, the allocator's triton
launches run in torch. The legacy hooks come first in each class's order (its `_kv_pools`
installs the torch launches, then builds the component's pools), but for the host tier,
whose op wrappers run around the legacy ops. `LEGACY_CLASSES` is `sglang_options.CLASSES`
for these releases.
"""

from __future__ import annotations

from typing import Any

from harness.conform.adapters.sglang_hicache import HostScheduled
from harness.conform.adapters.sglang_legacy import LegacyScheduled
from harness.conform.adapters.sglang_mamba import MambaScheduled, WindowMambaScheduled
from harness.conform.adapters.sglang_scheduler import SglangScheduled
from harness.conform.adapters.sglang_window import WindowScheduled


class LegacyWindowScheduled(LegacyScheduled, WindowScheduled):
    """A FULL+SWA UnifiedRadixCache under the scheduler code before 0.5.22."""

    def _swa_cursor(self, kv: Any) -> int:
        """`ReqKvInfo.swa_evicted_seqlen` before 0.5.21 (no `get_evicted_seqlen`)."""
        if hasattr(kv, "get_evicted_seqlen"):
            return super()._swa_cursor(kv)
        return int(kv.swa_evicted_seqlen)


class LegacyMambaScheduled(LegacyScheduled, MambaScheduled):
    """A FULL+MAMBA UnifiedRadixCache under the scheduler code before 0.5.22."""


class LegacyWindowMambaScheduled(LegacyWindowScheduled, WindowMambaScheduled):
    """A FULL+SWA+MAMBA UnifiedRadixCache under the scheduler code before 0.5.22."""


class LegacyHostScheduled(HostScheduled, LegacyScheduled):
    """A hierarchical (full-attention) UnifiedRadixCache under the scheduler code before
    0.5.22: each legacy op run as a HiCache step."""


# (a window, a state_interval) -> the adapter over that UnifiedRadixCache before 0.5.22
LEGACY_CLASSES: dict[tuple[bool, bool], type[SglangScheduled]] = {
    (False, False): LegacyScheduled, (True, False): LegacyWindowScheduled,
    (False, True): LegacyMambaScheduled, (True, True): LegacyWindowMambaScheduled}

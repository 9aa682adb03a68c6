"""Fault injection for testing the harness itself: an attention backend that reads
reused KV wrong and an engine that miscounts reuse, so a scenario fails for real (warm
differs from cold, reuse differs from the oracle) without mocking anything.

`StalePrefixBackend` is the torch reference backend, except that a prefill chunk reads
the KV of the tokens before it (a prefix it did not compute in this step) with values
shifted by `DRIFT`: what a backend that mis-reads copied or cached pages would do. An
unchunked cold run never reads such a prefix; a warm run reads its reused prefix that
way, so its logits (and usually its tokens) part from the cold run's. Decode steps read
correctly. It is not in kvcache's registry: engines take the class itself, and a repro
file names it as `tests.scenarios.faults:StalePrefixBackend`, a name the harness's repro
registry (harness/repro/registry.py) lists, so `kvharness repro` run from the repository
root builds it.

`OverCountingEngine` is kvcache's Engine, except that its statistics count one reused
full block twice once anything was reused: a bookkeeping bug (the cache and the outputs
are right), so `reusedBlocks` and `fullReusedBlocks` run one past the oracle. A test
builds it with `make_engine(..., engine_class=OverCountingEngine)`; the repro file names
it as `tests.scenarios.faults:OverCountingEngine` (listed there too). A new object a
recorded engine takes must be listed there for its repro files to re-run.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import ClassVar

import torch

from kvcache import Engine, KvCacheStats
from kvcache.attention.metadata import PagedMetadata
from kvcache.attention.reference import ReferenceBackend
from tests.scenarios.support import BackendSpec

DRIFT = 0.25  # far beyond float32's 1e-5 tolerance; the tiny model's values are O(1)


class StalePrefixBackend(ReferenceBackend):
    """Reference attention that mis-reads a prefill chunk's prefix (see the module)."""

    name: ClassVar[str] = "test-stale-prefix"

    def _plan(self, md: PagedMetadata) -> None:
        super()._plan(md)
        qo = md.qo_indptr.tolist()
        self._chunk_lens = [b - a for a, b in itertools.pairwise(qo)]
        self._prefix_lens = [kv - n for kv, n in zip(md.kv_lens.tolist(), self._chunk_lens,
                                                     strict=True)]

    def gather_kv(self, layer: int, request: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's keys and values; a prefill chunk's prefix values shifted."""
        keys, values = super().gather_kv(layer, request)
        prefix = self._prefix_lens[request]
        if self._chunk_lens[request] > 1 and prefix > 0:
            values = values.clone()
            values[:prefix] += DRIFT
        return keys, values


# float32 on CPU, the exact tolerance: any drift in reused KV fails the comparison.
STALE_PREFIX = BackendSpec(StalePrefixBackend, "cpu", torch.float32, 1e-5)


class OverCountingEngine(Engine):
    """An Engine whose statistics over-count reuse by one full block (see the module)."""

    def kv_cache_stats(self) -> KvCacheStats:
        """Engine.kv_cache_stats, with one more reused (full) block once any was reused."""
        stats = super().kv_cache_stats()
        if not stats.full_reused_blocks:
            return stats
        return replace(stats, reused_blocks=stats.reused_blocks + 1,
                       full_reused_blocks=stats.full_reused_blocks + 1)

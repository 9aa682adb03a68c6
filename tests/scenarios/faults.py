"""Fault injection for testing the harness itself: an attention backend that reads
reused KV wrong, so a scenario fails for real (warm differs from cold) without mocking
anything.

`StalePrefixBackend` is the torch reference backend, except that a prefill chunk reads
the KV of the tokens before it (a prefix it did not compute in this step) with values
shifted by `DRIFT`: what a backend that mis-reads copied or cached pages would do. An
unchunked cold run never reads such a prefix; a warm run reads its reused prefix that
way, so its logits (and usually its tokens) part from the cold run's. Decode steps read
correctly. It is not in the registry: engines take the class itself, and a repro file
names it as `tests.scenarios.faults:StalePrefixBackend`, which `kvharness repro` imports
when run from the repository root.
"""

from __future__ import annotations

import itertools
from typing import ClassVar

import torch

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

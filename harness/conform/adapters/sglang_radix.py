"""The `sglang` engine's adapter, what `ADAPTERS["sglang"]` loads: SGLang's `RadixCache`
(`sglang.SglangCache`, or SGLang's own scheduler code over it where that runs, 0.5.22
on) and, for a cache opened with a window where that code does not run, SGLang's
`SWARadixCache` over its SWA pools (`sglang_swa.SwaCache`). The machinery both share
with `sglang_unified` is `sglang`'s; this module only joins the two trees, so neither
of their modules imports the other's caller.
"""

from __future__ import annotations

from harness.conform.adapters import sglang_swa
from harness.conform.adapters.sglang import (
    CONTRACT_RELEASES,
    MODULES,
    SglangCache,
    SglangNames,
    contract,
    load_sglang,
)
from harness.conform.protocol import LoadedEngine
from harness.conform.stubs import StubSpec


class RadixNames(SglangNames):
    """`SglangNames` with this release's SWARadixCache and its pools, or why they cannot
    be opened here (`sglang_swa.swa_names`)."""

    def __init__(self) -> None:
        super().__init__()
        self.swa, self.no_swa = sglang_swa.swa_names()


def load(stubs: StubSpec, version: str | None = None) -> LoadedEngine:
    """Prime the probes, install `stubs`, import SGLang's RadixCache and return the
    engine; `version` is used where SGLang has no metadata (a source tree). Raises
    ImportError when it does not import, RuntimeError when a package to stub is
    installed."""
    return load_sglang(stubs, "sglang", MODULES, RadixNames, SglangCache, version,
                       CONTRACT_RELEASES, "radix", contract, window_cache=sglang_swa.SwaCache)

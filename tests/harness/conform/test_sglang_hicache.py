"""SGLang's host tier behind the protocol (`harness.conform.adapters.sglang_hicache`):
engine free, the host-register no-op is scoped and restored, the copy stand-in copies
what sgl-kernel's `transfer_kv_direct` copies, the host args size an inclusive host,
and the contract honours host_blocks only where it opens it (saying why elsewhere); one
op list that reuses from the host runs on the cached 0.5.23 install (skipped where it
is not cached, as the engine smoke is)."""

from __future__ import annotations

import collections
import re
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.conform import ops
from harness.conform.adapters import sglang_hicache as H
from harness.conform.adapters import sglang_legacy, sglang_options
from harness.conform.adapters.sglang import contract as radix_contract
from harness.conform.adapters.sglang_scheduler import UNIFIED_MAMBA
from harness.conform.adapters.sglang_unified import contract as unified_contract
from harness.conform.controller.checks import check_named
from harness.conform.controller.judge import Judge
from harness.conform.controller.locks import find_lock, pinned, supported
from harness.conform.controller.targets import Target
from harness.conform.protocol import CacheOptions
from harness.conform.versions import parse_version
from tests.harness.conform.cached_engines import open_cached

B = 4
LOCK = next(lock for lock in pinned() if lock.engine == "sglang_unified")


def _common() -> types.SimpleNamespace:
    def _cuda_host_register(buffer, registration_granularity_bytes=None):
        raise AssertionError("Torch not compiled with CUDA enabled")

    return types.SimpleNamespace(_cuda_host_register=_cuda_host_register)


def test_host_register_is_a_no_op_inside_and_restored_after() -> None:
    common = _common()
    own = common._cuda_host_register
    with H.unregistered(torch, common):
        assert common._cuda_host_register(torch.zeros(2)) is None
    assert common._cuda_host_register is own


def test_host_register_is_restored_when_the_body_raises() -> None:
    common = _common()
    own = common._cuda_host_register
    with pytest.raises(RuntimeError, match="boom"), H.unregistered(torch, common):
        raise RuntimeError("boom")
    assert common._cuda_host_register is own


def _pool_host_0513() -> types.SimpleNamespace:
    """0.5.13's memory_pool_host, as far as page-locking goes: `ALLOC_MEMORY_FUNCS`, a
    defaultdict keyed by the device pool's device whose default (and its "cpu" entry) is
    `alloc_with_host_register`, which page-locks where `pin_memory` is set; here it
    records its arguments and refuses to page-lock, as a CPU-only torch does."""
    calls: list[bool] = []

    def alloc_with_host_register(dims, dtype, device, pin_memory, allocator):
        calls.append(pin_memory)
        if pin_memory:
            raise AssertionError("Torch not compiled with CUDA enabled")
        return torch.empty(dims, dtype=dtype, device=device)

    funcs = collections.defaultdict(lambda: alloc_with_host_register)
    return types.SimpleNamespace(ALLOC_MEMORY_FUNCS=funcs, calls=calls,
                                 alloc_with_host_register=alloc_with_host_register)


@pytest.mark.parametrize("present", [False, True], ids=["key-absent", "key-present"])
def test_0513s_inline_page_lock_allocates_unpinned_inside_and_is_restored(present) -> None:
    """0.5.13 page-locks inside the host pool's allocation: inside, the device's entry
    is the same allocation with pin_memory off; on exit (also when the body raises) the
    table is as it was, an entry present before back, an absent one absent again."""
    pool = _pool_host_0513()
    if present:
        pool.ALLOC_MEMORY_FUNCS["cpu"] = pool.alloc_with_host_register
    with pytest.raises(RuntimeError, match="boom"), H.unregistered(torch, pool, "cpu"):
        buffer = pool.ALLOC_MEMORY_FUNCS["cpu"]((2, 3), dtype=torch.float16, device="cpu",
                                                pin_memory=True, allocator=None)
        assert buffer.shape == (2, 3) and buffer.dtype == torch.float16
        raise RuntimeError("boom")
    assert pool.calls == [False]
    assert ("cpu" in pool.ALLOC_MEMORY_FUNCS) is present
    with pytest.raises(AssertionError, match="CUDA"):  # page-locking again outside
        pool.ALLOC_MEMORY_FUNCS["cpu"]((2,), dtype=torch.float16, device="cpu",
                                       pin_memory=True, allocator=None)


def test_the_copy_is_bound_only_inside_and_only_where_unbound() -> None:
    mha = types.SimpleNamespace()
    with H.kv_copy_bound(mha):
        assert mha.transfer_kv_direct is H.transfer_kv_direct
    assert not hasattr(mha, "transfer_kv_direct")
    with pytest.raises(ValueError), H.kv_copy_bound(mha):
        raise ValueError
    assert not hasattr(mha, "transfer_kv_direct")
    kernel = object()
    bound = types.SimpleNamespace(transfer_kv_direct=kernel)
    with H.kv_copy_bound(bound):
        assert bound.transfer_kv_direct is kernel


def test_the_copy_moves_whole_pages_as_a_per_index_copy_does() -> None:
    P = 2
    src = [torch.arange(24.0).reshape(12, 2) + 100 * layer for layer in range(3)]
    dst = [torch.zeros(12, 2) for _ in range(3)]
    want = [d.clone() for d in dst]
    src_idx = torch.tensor([4, 5, 0, 1, 8, 9])
    dst_idx = torch.tensor([2, 3, 10, 11, 6, 7])
    for s_, d_ in zip(src, want, strict=True):
        d_[dst_idx] = s_[src_idx]  # the plain per-index copy
    H.transfer_kv_direct(src, dst, src_idx, dst_idx, P)
    for got, exp in zip(dst, want, strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize(("src_n", "dst_n", "idx", "page"), [
    (2, 1, 4, 2), (1, 1, 3, 2), (1, 1, 4, 0)])
def test_the_copy_refuses_what_the_kernel_refuses(src_n, dst_n, idx, page) -> None:
    src = [torch.zeros(8, 2) for _ in range(src_n)]
    dst = [torch.zeros(8, 2) for _ in range(dst_n)]
    with pytest.raises(RuntimeError, match="transfer_kv_direct"):
        H.transfer_kv_direct(src, dst, torch.arange(idx), torch.arange(4), page)


def test_the_host_holds_the_device_copy_and_host_blocks_beyond() -> None:
    args = H.host_args(8, 8)
    assert args["hicache_ratio"] == 2.0 and args["hicache_size"] == 0
    assert args["hicache_write_policy"] == "write_through"
    assert args["hicache_io_backend"] == "direct"


def test_blocked_releases_say_what_blocks_them() -> None:
    reasons = {v: H.blocked_reason(v, "radix")
               for v in ("0.5.5", "0.5.12", "0.5.10", "0.5.9")}
    assert {name for name, _ in reasons.values()} == {"options.host_blocks"}
    assert "sgl_kernel.kvcacheio" in reasons["0.5.5"][1]
    assert "sgl_kernel.kvcacheio" in reasons["0.5.12"][1]
    # 0.5.10's was tried: its events count both tiers; 0.5.9's are the same, read there
    assert "publishes no BlockRemoved" in reasons["0.5.10"][1]
    assert "hiradix_cache.py:820-831 _evict_backuped" in reasons["0.5.9"][1]
    assert H.honoured_radix("0.5.13.post1") and not H.honoured_radix("0.5.12")
    # every locked release the adapter does not open says what blocks it, at its lines
    below = [v for v in supported()["sglang"]
             if parse_version(v).key < parse_version("0.5.13").key]
    assert below and all(H.blocked_reason(v, "radix")[1] != H.HIRADIX for v in below)
    assert all(re.search(r"\.py:[0-9]+-[0-9]+", H.blocked_reason(v, "radix")[1])
               for v in below)


def _names(hicache: bool) -> types.SimpleNamespace:
    """What `sglang_options.contract` reads of the scheduler's names (0.5.23's)."""
    return types.SimpleNamespace(swa=("pool", "allocator", "SWA"), mamba=("pools",),
                                 mamba_radix=None, no_mamba_radix=UNIFIED_MAMBA,
                                 names_requests=True, hicache=hicache, checkpoints=True)


def test_host_blocks_is_honoured_apart_from_a_window_and_a_state_interval() -> None:
    base = unified_contract("0.5.23", B)
    plain = sglang_options.contract(base, _names(True), "unified")
    assert plain.options == ("window", "chunk_budget", "window_pool", "state_interval",
                            "host_blocks")
    assert plain.host_blocks is None and not set(H.REPLICATED) & set(plain.replicated)
    host = sglang_options.contract(base, _names(True), "unified", host_blocks=8)
    assert host.options == ("chunk_budget", "host_blocks")
    assert host.host_blocks == 8 and not host.bounded_oracle
    assert set(H.REPLICATED) <= set(host.replicated)
    assert "registry.py:193-196" in dict(host.citations)["host_blocks"]
    assert "mha.py:60-89" in H.COPY_STUB[1] and "common.py:143-349" in H.REGISTER_STUB[1]
    windowed = sglang_options.contract(base, _names(True), "unified", 8)
    states = sglang_options.contract(base, _names(True), "unified", state_interval=2)
    assert "host_blocks" not in windowed.options + states.options


def test_radix_cache_releases_read_open_hiradix_cache_with_its_own_rule() -> None:
    """0.5.14-0.5.20's host tier is HiRadixCache beside RadixCache: its contract honours
    host_blocks and cites HiRadixCache's lines (0.5.14's before its host pool moved to
    pool_host in 0.5.16), not UnifiedRadixCache's."""
    plain = sglang_options.contract(radix_contract("0.5.18", B), _names(False), "radix")
    assert "host_blocks" in plain.options
    host = sglang_options.contract(radix_contract("0.5.18", B), _names(False), "radix",
                                   host_blocks=8)
    cited = dict(host.citations)
    assert cited["host_blocks"] == H.HIRADIX_RULE and "hiradix_cache.py" in cited["host_stores"]
    assert host.host_blocks == 8 and set(H.REPLICATED) <= set(host.replicated)
    # as the legacy scheduler code opens it: its own replicated parts, the host tier's kept
    legacy = sglang_legacy.contract(host)
    assert set(H.REPLICATED) | set(sglang_legacy.LEGACY_REPLICATED) == set(legacy.replicated)
    older = sglang_options.contract(radix_contract("0.5.14", B), _names(False), "radix",
                                    host_blocks=8)
    assert dict(older.citations)["host_blocks"] == H.HIRADIX_RULE_0514
    assert "memory_pool_host.py" in H.HIRADIX_RULE_0514
    assert H.REGISTER_STUB in older.replicated
    # 0.5.13 page-locks inline: its own rule, its own stand-in for the page-lock
    inline = sglang_options.contract(radix_contract("0.5.13", B), _names(False), "radix",
                                     host_blocks=8)
    assert dict(inline.citations)["host_blocks"] == H.HIRADIX_RULE_0513
    assert H.REGISTER_STUB_0513 in inline.replicated
    assert H.REGISTER_STUB not in inline.replicated and H.COPY_STUB in inline.replicated


def test_where_no_host_tier_opens_the_skip_says_what_blocks_it() -> None:
    unread = sglang_options.contract(unified_contract("0.5.18", B), _names(True), "unified")
    radix = sglang_options.contract(radix_contract("0.5.23", B), _names(True), "radix")
    # 0.5.9 was read: its own blocker; 0.5.11 (no lock) was not
    read = sglang_options.contract(radix_contract("0.5.9", B), _names(False), "radix")
    old = sglang_options.contract(radix_contract("0.5.11", B), _names(False), "radix")
    for contract, why in ((unread, "not read (read: 0.5.19, 0.5.20"), (radix, "not RadixCache's"),
                          (read, "hiradix_cache.py:820-831 _evict_backuped"),
                          (old, "HiRadixCache")):
        assert "host_blocks" not in contract.options
        assert why in str(check_named("host_tier").skip_reason(contract))
    # the reason is the option's: a family asking for another option does not show it
    assert "host" not in str(check_named("hybrid_state").skip_reason(
        sglang_options.contract(radix_contract("0.5.23", B), _names(True), "radix")))


@pytest.fixture(params=[LOCK, find_lock("sglang_unified", "0.5.19"),
                        find_lock("sglang", "0.5.20"), find_lock("sglang", "0.5.14"),
                        find_lock("sglang", "0.5.13")],
                ids=["unified-radix-cache", "legacy-unified-0.5.19", "hiradix-cache-0.5.20",
                     "hiradix-cache-0.5.14", "hiradix-cache-0.5.13"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """The newest `sglang_unified` (UnifiedRadixCache.init_hicache; and 0.5.19's under its
    older scheduler code), and SGLang 0.5.20,
    0.5.14 and 0.5.13 (HiRadixCache beside RadixCache, under its own scheduler code;
    0.5.14's host pool in memory_pool_host.py, 0.5.13's page-locked inline there)."""
    with open_cached(request.param, tmp_path) as opened:
        yield opened


def test_a_prefix_evicted_from_the_device_is_reused_from_the_host(target: Target) -> None:
    """A pool of 8 pages, a host of 8 beyond: A (4 pages) is written through to the
    host; B (6 pages) evicts A from the device; A again reuses all 16 tokens, loaded
    back from the host by SGLang's own match and load-back, the pages' moves logged
    (provenance holds) and every oracle with them."""
    contract = target.open(8, B, CacheOptions(host_blocks=8))
    assert contract.host_blocks == 8
    judge = Judge(contract, 8)
    a, b = list(range(100, 116)), list(range(500, 524))
    reports = target.apply_all([
        ops.admit("A", a), ops.commit("A", 16), ops.free("A"),
        ops.admit("B", b), ops.commit("B", 24), ops.free("B"),
        ops.admit("A2", [*a, 1]), ops.commit("A2", 17), ops.free("A2")])
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    assert all(r.integrity == () for r in reports)
    assert reports[3].stats.engine["evictable_size"] == 0  # A left the device
    assert reports[6].value["reused_tokens"] == 16


@pytest.mark.parametrize(("version", "backup", "load"), [
    ("0.5.19", "starts inside the insert (mem_cache/hybrid_cache/hybrid_cache_controller.py"
               ":309-337", "total_tokens, checked at :1212"),
    ("0.5.20", "there is no flush_pending_backups", "schedule_policy.py:1364"),
    ("0.5.21", "queued (mem_cache/hybrid_cache/hybrid_cache_controller.py:513-536",
     "checked at :1377"),
    ("0.5.22", "check_hicache_events (unified_radix_cache.py:3507-3539", "1425-1446"),
    ("0.5.23", "unified_tree_core.py:2849 finish_write_through", "1499-1523")])
def test_each_release_cites_its_own_unified_host_rule(version: str, backup: str,
                                                      load: str) -> None:
    """UnifiedRadixCache's host rules of each release at its own lines: 0.5.19-0.5.20
    start a backup's copy inside the insert, 0.5.21 on queue it for check_hicache_events;
    before 0.5.22 PrefillAdder charges the prompt past the device prefix up front (no
    prepare_load_back); before 0.5.22 a chunked request's middle chunk is backed up later."""
    cited = dict(H.unified_rules(version))
    assert set(cited) == {"host_blocks", "host_full_hit", "host_load_reserve", "host_stores"}
    assert backup in cited["host_blocks"] and load in cited["host_load_reserve"]
    assert ("middle chunk backs nothing up" in cited["host_stores"]) == \
        (version in ("0.5.19", "0.5.20", "0.5.21"))
    assert not any("{" in text for text in cited.values())
    assert dict(H.rules("unified", version)) == cited
    with pytest.raises(KeyError):
        H.unified_rules("0.5.18")

"""SGLang's Mamba cache behind the protocol: a FULL+MAMBA `UnifiedRadixCache` over
SGLang's hybrid Mamba pools, driven by its scheduler code (`sglang_unified`, 0.5.23),
and 0.5.14's `MambaRadixCache` under that release's older code (`sglang_mamba_radix`).
The pin shim, the slot integrity and the contracts are checked without an engine; the
op lists that decode past a state block and refuse an admission run on the cached
0.5.23 and 0.5.14 installs (each skipped where it is not cached, as the engine smoke
is)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.conform import ops
from harness.conform.adapters import (
    sglang_legacy,
    sglang_mamba,
    sglang_mamba_radix,
    sglang_options,
)
from harness.conform.adapters.sglang import contract as radix_contract
from harness.conform.adapters.sglang_unified import contract as unified_contract
from harness.conform.controller.checks import check_named
from harness.conform.controller.judge import Judge
from harness.conform.controller.locks import find_lock, pinned
from harness.conform.controller.targets import Target
from harness.conform.protocol import CacheOptions
from tests.harness.conform.cached_engines import open_cached

B = 4
LOCK = next(lock for lock in pinned() if lock.engine == "sglang_unified")


def test_pin_memory_is_the_identity_only_inside_and_is_restored_after_a_raise() -> None:
    before = torch.Tensor.pin_memory
    assert not torch.accelerator.is_available()  # the harness's torch is a CPU build
    t = torch.zeros(3)
    with pytest.raises(RuntimeError, match="accelerator"):
        t.pin_memory()  # what prepare_for_decode meets on a CPU
    factory = torch.tensor
    with pytest.raises(RuntimeError, match="pin_memory"):
        torch.tensor([1, 0], pin_memory=True)  # 0.5.14's track indices
    with sglang_mamba.unpinned(torch):
        assert t.pin_memory() is t
        built = torch.tensor([1, 0], dtype=torch.int64, pin_memory=True)
        assert built.tolist() == [1, 0] and built.dtype == torch.int64
    assert torch.Tensor.pin_memory is before and torch.tensor is factory
    assert "pin_memory" not in torch.Tensor.__dict__  # inherited again, as before
    with pytest.raises(KeyError), sglang_mamba.unpinned(torch):
        assert t.pin_memory() is t
        raise KeyError("the call raised")
    assert torch.Tensor.pin_memory is before and torch.tensor is factory


def _req(working: int | None, track: list[int], empty: list[bool]) -> SimpleNamespace:
    buffer = torch.tensor(track) if track else None
    return SimpleNamespace(kv=SimpleNamespace(
        mamba_pool_idx=None if working is None else torch.tensor(working),
        mamba_ping_pong_track_buffer=buffer, mamba_ping_pong_empty=empty))


def _pool(size: int, free: list[int]) -> SimpleNamespace:
    return SimpleNamespace(mamba_allocator=SimpleNamespace(
        size=size, free_slots=torch.tensor(free, dtype=torch.int64)))


def _tree(states: list[int]) -> SimpleNamespace:
    return SimpleNamespace(all_mamba_values_flatten=lambda: torch.tensor(states))


def test_every_mamba_slot_is_free_a_tree_state_or_one_requests_own() -> None:
    """Slots 1..8: a request holds 1 (working) and 2, 3 (ping-pong), the tree 4, 5."""
    held = _req(1, [2, 3], [False, False])
    assert sglang_mamba.request_slots(held) == [1, 2, 3]
    assert sglang_mamba.request_slots(_req(1, [2, -1], [False, True])) == [1, 2]
    assert sglang_mamba.slot_problems(_pool(8, [6, 7, 8]), _tree([4, 5]), [held]) == []
    leaked = sglang_mamba.slot_problems(_pool(8, [7, 8]), _tree([4, 5]), [held])
    assert leaked == ["Mamba slots owned by nobody (leaked): [6]"]
    shared = sglang_mamba.slot_problems(_pool(8, [6, 7, 8]), _tree([3, 4, 5]), [held])
    assert shared == ["Mamba slots both held and tree states: [3]"]
    twice = sglang_mamba.slot_problems(_pool(8, [6, 7, 8, 8]), _tree([4, 5]), [held])
    assert twice == ["Mamba slots twice among the free: [8]"]


def test_a_mamba_contract_lists_the_pin_stub_with_the_line_it_stands_in_for() -> None:
    names = SimpleNamespace(swa=None, mamba=("pools",), names_requests=True, hicache=False,
                            checkpoints=True)
    base = unified_contract("0.5.23", B)
    plain = sglang_options.contract(base, names, "unified")
    hybrid = sglang_options.contract(base, names, "unified", state_interval=2)
    assert sglang_mamba.PIN_STUB not in plain.replicated
    assert sglang_mamba.PIN_STUB in hybrid.replicated
    assert "schedule_batch.py:3830" in sglang_mamba.PIN_STUB[1]
    assert (hybrid.state_interval, hybrid.state_rule) == (2, "extend-end")
    assert hybrid.options == ("chunk_budget", "state_interval")
    both = sglang_options.contract(base, SimpleNamespace(swa=("SWA",), mamba=("pools",),
                                                           names_requests=True,
                                                           hicache=False, checkpoints=True),
                                     "unified", 8, state_interval=2)
    assert both.options == ("window", "chunk_budget", "window_pool", "state_interval")
    assert (both.window, both.window_layout, both.state_rule) == (8, "window-pool",
                                                                  "extend-end")


@pytest.mark.parametrize(("version", "why"), [
    pytest.param("0.5.18", "MambaRadixCache is not driven here: its server builds "
                 "UnifiedRadixCache's", id="beside-radix-cache"),
    pytest.param("0.5.23", "not RadixCache's", id="unified-only")])
def test_a_radix_cache_release_says_why_it_opens_no_mamba_state(version: str,
                                                                why: str) -> None:
    """Where no MambaRadixCache is driven, no cache over RadixCache opens with a
    state_interval: up to 0.5.20 the skip gives the reason the scheduler's names found
    (`no_mamba_radix`), from 0.5.21 the state is the unified tree's alone."""
    names = SimpleNamespace(swa=None, mamba=None, mamba_radix=None,
                            no_mamba_radix="its server builds UnifiedRadixCache's",
                            names_requests=False, hicache=False, checkpoints=False)
    terms = sglang_options.contract(radix_contract(version, B), names, "radix")
    assert "state_interval" not in terms.options
    assert why in str(check_named("hybrid_state").skip_reason(terms))


def test_a_mamba_radix_contract_cites_its_own_rule_and_pin_stub() -> None:
    """Where the release's server builds MambaRadixCache, a RadixCache release honours a
    state_interval: its contract cites MambaRadixCache's rule (0.5.14's lines) and the
    pin stub at those releases' line, and the legacy contract keeps both."""
    names = SimpleNamespace(swa=None, mamba=None, mamba_radix=("pools",), no_mamba_radix="",
                            names_requests=False, hicache=False, checkpoints=False)
    base = radix_contract("0.5.14", B)
    assert "state_interval" in sglang_options.contract(base, names, "radix").options
    terms = sglang_legacy.contract(sglang_options.contract(base, names, "radix",
                                                           state_interval=2))
    assert (terms.state_interval, terms.state_rule) == (2, "extend-end")
    assert ("state_interval", sglang_mamba_radix.MAMBA_RADIX_RULE) in terms.citations
    assert sglang_mamba_radix.PIN_STUB in terms.replicated
    assert sglang_mamba.PIN_STUB not in terms.replicated
    assert set(sglang_legacy.LEGACY_REPLICATED) <= set(terms.replicated)


# the trees with a Mamba state: UnifiedRadixCache's MAMBA component (0.5.23; 0.5.19 and
# 0.5.21 under their older scheduler code), and MambaRadixCache under the legacy
# scheduler code of a release whose server builds it
TREES = [pytest.param(LOCK, id="unified-0.5.23"),
         *(pytest.param(find_lock("sglang_unified", v), id=f"legacy-unified-{v}")
           for v in ("0.5.19", "0.5.21")),
         pytest.param(find_lock("sglang", "0.5.14"), id="mamba-radix-0.5.14")]


@pytest.fixture(params=TREES)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    with open_cached(request.param, tmp_path) as opened:
        yield opened


def test_a_decoded_state_block_is_kept_and_reused(target: Target) -> None:
    """States every 8 tokens (2 pages): A's prompt of 10 keeps 8; its 7 decode steps run
    on a CPU and the result processor tracks the state at 16, which A gives the tree
    when it ends, so B (A's 17 tokens and one more) reuses 16 where the prompt's state
    alone would give 8; every oracle and the Mamba slot pool's accounting hold."""
    _decode_past_a_state_block(target, None)


def test_a_decoded_state_block_is_kept_with_a_window_too_wide(target: Target) -> None:
    """The same with a window of 8: FULL+SWA+MAMBA, the window pool's accounting too
    (UnifiedRadixCache only: MambaRadixCache keeps no window)."""
    if "window" not in target.open(16, B, CacheOptions(state_interval=2)).options:
        pytest.skip("MambaRadixCache has no window beside its Mamba state")
    _decode_past_a_state_block(target, 8)


def _decode_past_a_state_block(target: Target, window: int | None) -> None:
    contract = target.open(16, B, CacheOptions(window=window, state_interval=2))
    assert (contract.state_interval, contract.state_rule) == (2, "extend-end")
    assert contract.window == window
    judge = Judge(contract, 16)
    a, out = list(range(100, 110)), list(range(1, 8))
    op_list = [ops.admit("A", a), ops.commit("A", 10)]
    for i, t in enumerate(out):
        op_list += [ops.append("A", [t]), ops.commit("A", 11 + i)]
    op_list += [ops.free("A"), ops.admit("B", [*a, *out, 50]), ops.commit("B", 18),
                ops.free("B")]
    reports = target.apply_all(op_list)
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    assert all(r.integrity == () for r in reports)
    assert reports[-3].value["reused_tokens"] == 16
    engine = reports[-3].stats.engine
    assert engine["mamba_evictable_size"] + engine["mamba_protected_size"] >= 1
    assert ("swa_available_size" in engine) == (window is not None)


def test_a_refused_admission_gives_back_the_mamba_slot_its_match_took(target: Target) -> None:
    """A pool of 4 pages: A (10 tokens) keeps its state at 8 and holds 3 pages; B
    extending A's first 8 matches that state (its match copies it into a Mamba slot of
    B's own) but cannot have its 3 new pages, and the refusal leaves the Mamba pool as
    it was (SGLang's abort of a queued request releases that slot)."""
    contract = target.open(4, B, CacheOptions(state_interval=2))
    judge = Judge(contract, 4)
    a = list(range(100, 110))
    reports = target.apply_all([ops.admit("A", a), ops.commit("A", 10),
                                ops.admit("B", [*a[:8], *range(200, 212)])])
    found = [v for r in reports for v in judge.observe(r)]
    assert found == [], found
    assert reports[-1].status == "refused"
    assert reports[-1].stats.engine["mamba_available_size"] == \
        reports[-2].stats.engine["mamba_available_size"]
    assert all(r.integrity == () for r in reports)


@pytest.mark.parametrize(("version", "insert", "pinned"), [
    ("0.5.19", "cache_unfinished_req (through maybe_cache_unfinished_req, "
               "mem_cache/common.py:161)", ":2026 set_mamba_track_indices_from_reqs"),
    ("0.5.21", "insert_req (up_to=owned_kv_len, :316)", ":2229"),
    ("0.5.22", "checkpoint_kv_cache inserts", ":2226"),
    ("0.5.23", "_select_finished_checkpoint, used at :632", "schedule_batch.py:3830")])
def test_each_release_cites_its_own_mamba_rule_and_pin_stub(version: str, insert: str,
                                                            pinned: str) -> None:
    """The Mamba rule of each release is cited at its own lines, with the caller that
    keeps the full KV to the last state (the tree's cache_unfinished_req before 0.5.22);
    before 0.5.23 the pin stub also names the page-locked track indices."""
    rule = sglang_mamba.mamba_rule(version)
    assert insert in rule and "{" not in rule
    stub = sglang_mamba.pin_stub(version)
    assert pinned in stub[1] and stub[0] == sglang_mamba.PIN_STUB[0]
    assert (stub == sglang_mamba.PIN_STUB) == (version == "0.5.23")

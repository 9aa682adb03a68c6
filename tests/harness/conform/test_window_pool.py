"""A window pool smaller than the full one (`Contract.window_pool`, SGLang's
`--swa-full-tokens-ratio`), without an engine: how the adapter sizes it as SGLang's server
does and refuses what the server refuses, what the contract says, what the fuzz draws, and
the judge allowing a match shortened by window tombstones only where the tree holds them
(hand-written logs, blocks of 4)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from harness.conform import ops
from harness.conform.adapters import sglang_options
from harness.conform.adapters.sglang_unified import contract as unified_contract
from harness.conform.adapters.sglang_window import window_pool_tokens
from harness.conform.controller.fuzz import POOL_SIZES, fuzz_options
from harness.conform.controller.judge import Judge
from harness.conform.protocol import CacheOptions, Contract, Stats
from harness.conform.worker.session import StepReport

B = 4
A = list(range(100, 112))


def _names() -> SimpleNamespace:
    """What `sglang_options.contract` reads: a release with the tree's SWA component."""
    return SimpleNamespace(swa=("pool", "allocator", "SWA"), mamba=None, no_mamba="none here",
                           names_requests=True, hicache=False, checkpoints=True)


def _contract(window_pool: int | None) -> Contract:
    return sglang_options.contract(unified_contract("0.5.23", B), _names(), "unified", 8,
                                   window_pool=window_pool)


def test_the_window_pool_is_sized_and_refused_as_sglangs_server_does() -> None:
    assert window_pool_tokens(None, 32, B, 8) == 128  # as large as the full pool
    assert window_pool_tokens(8, 32, B, 8) == 32  # ratio 0.25: 32 tokens
    assert window_pool_tokens(4, 32, B, 11) == 16  # 11 + 4 < 16
    with pytest.raises(ValueError, match=r"window_pool 3 \(12 tokens\) cannot hold one request"):
        window_pool_tokens(3, 32, B, 8)  # 8 + 4 >= 12: validate_swa_pool_size
    with pytest.raises(ValueError, match="window_pool 33 is larger than the full pool"):
        window_pool_tokens(33, 32, B, 8)


def test_the_contract_lists_and_cites_the_window_pool() -> None:
    plain = sglang_options.contract(unified_contract("0.5.23", B), _names(), "unified")
    assert plain.options == ("window", "chunk_budget", "window_pool")
    short = _contract(8)
    assert (short.window, short.window_layout, short.window_pool) == (8, "window-pool", 8)
    cited = dict(short.citations)["window_pool"]
    for where in ("pool_configurator.py:879-881", "pool_configurator.py:198-216",
                  "swa.py:694-724", "swa.py:369-375"):
        assert where in cited
    assert "window_pool" not in dict(_contract(None).citations)
    with pytest.raises(ValueError, match=r"Contract\.window_pool 8 needs a window"):
        replace(short, window=None)
    with pytest.raises(ValueError, match=r"Contract\.window_pool 8 needs a window"):
        replace(short, window_layout="full-and-window")


def test_the_fuzz_draws_a_smaller_window_pool_only_with_a_window() -> None:
    def honoured(chosen: CacheOptions) -> tuple[str, ...]:
        return ("window", "chunk_budget", "window_pool")

    drawn = [(fuzz_options(seed, honoured, n), n) for seed in range(200) for n in POOL_SIZES]
    pools = [(o, n) for o, n in drawn if o.window_pool is not None]
    assert pools, "no seed drew a window pool"
    for o, n in pools:
        assert o.window is not None
        window_pool_tokens(o.window_pool, n, B, o.window)  # SGLang's server takes it
        assert o.window_pool < n
    assert any(o.window is not None and o.window_pool is None for o, _ in drawn)
    # without the option honoured, never
    assert all(fuzz_options(seed, lambda c: ("window",), 16).window_pool is None
               for seed in range(200))


def _report(op: Any, value: Any, log: list[dict[str, Any]], used: int, gap: int,
            status: str = "done") -> StepReport:
    return StepReport(op, status, value, "", tuple(log), (), used, None,  # type: ignore[arg-type]
                      Stats({}, {"windowGapTokens": gap}))


def _run(contract: Contract, gap: int, reused: int) -> list[Any]:
    """A computes 12 tokens and ends; `gap` tokens of the tree lack window KV after;
    B (20 tokens) sharing A's 12 reuses `reused`."""
    contract = replace(contract, events=False)
    j = Judge(contract, 16)
    b = [*A, *range(1, 9)]
    got = j.observe(_report(ops.admit("A", A), {"reused_tokens": 0}, [
        {"kind": "admit", "seq_id": "A", "tokens": A, "num_tokens": 0, "scope": None,
         "block_ids": [1, 2, 3]},
        {"kind": "commit", "seq_id": "A", "num_tokens": 12}], 3, 0))
    got += j.observe(_report(ops.free("A"), None, [{"kind": "free", "seq_id": "A"}], 0, gap))
    kept = [1, 2, 3][:reused // B]
    got += j.observe(_report(ops.admit("B", b), {"reused_tokens": reused}, [
        {"kind": "admit", "seq_id": "B", "tokens": b, "num_tokens": reused, "scope": None,
         "block_ids": kept + list(range(4, 9 - len(kept)))}], 5, gap))
    return got


def test_a_match_shortened_by_window_tombstones_is_no_finding() -> None:
    assert _run(_contract(8), gap=8, reused=0) == []
    assert _run(_contract(8), gap=8, reused=8) == []
    assert _run(_contract(8), gap=0, reused=12) == []  # no tombstone: the whole match


@pytest.mark.parametrize(("window_pool", "gap", "reused", "says"), [
    pytest.param(8, 0, 0, "predicts 12", id="no-tombstone"),
    pytest.param(None, 8, 0, "predicts 12", id="equal-pools"),
    pytest.param(8, 8, 16, "predicts 12", id="longer")])
def test_a_shortened_match_without_the_window_pools_tombstones_is_a_count_finding(
        window_pool: int | None, gap: int, reused: int, says: str) -> None:
    found = _run(_contract(window_pool), gap=gap, reused=reused)
    assert [v.oracle for v in found][:1] == ["count"], found
    assert says in found[0].message


def test_what_an_admission_needs_of_a_smaller_window_pool_is_not_judged() -> None:
    op = ops.admit("A", A)
    assert Judge(replace(_contract(8), window=8), 16)._need(op) is None
    assert Judge(replace(_contract(None), window=None, window_layout="window-only"),
                 16)._need(op) is not None

"""The families that open a cache with a host tier or a hybrid model's recurrent state:
kvcache passes them, an adapter whose cache ignores the option it says it honours is
found by the count oracle, and an engine that honours neither skips them saying so."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from harness.conform.adapters import kvcache
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.adapters.sglang import contract as sglang_contract
from harness.conform.adapters.vllm_scheduler import honoured
from harness.conform.controller.checks import check_named
from harness.conform.controller.fuzz import fuzz_options
from harness.conform.controller.runner import run_check
from harness.conform.controller.targets import LocalTarget
from harness.conform.protocol import CacheOptions

HOST, STATES = check_named("host_tier"), check_named("hybrid_state")


class IgnoresOption(KvcacheCache):
    """Says it honours the options but builds kvcache's manager without them."""

    def __init__(self, num_blocks: int, block_size: int, *, record: bool = True,
                 options: CacheOptions | None = None) -> None:
        super().__init__(num_blocks, block_size, record=record)
        if options is not None:
            # the contract of the asked options, over a cache that has neither; reuse
            # aligned to one block does not start inside one either
            self._contract = replace(kvcache.contract(block_size, options),
                                     partial_reuse=False, copy_on_partial_reuse=False)
            self.manager = self._plain(num_blocks, block_size, record)

    def _plain(self, num_blocks: int, block_size: int, record: bool) -> Any:
        k = self._kvcache
        cfg = k.KvCacheConfig(tokens_per_block=block_size, max_num_blocks=num_blocks,
                              enable_block_reuse=True, enable_partial_reuse=False)
        return k.KvCacheManager(cfg, record_events=record, kv_events=record)


def test_kvcache_keeps_blocks_on_its_host_tier_and_matches_to_kept_states() -> None:
    target = LocalTarget(kvcache.load())
    for check in (HOST, STATES):
        result = run_check(target, check)
        assert result.status == "pass", (check.name, result.message)
    assert run_check(target, HOST).observed[
        "A again (its 16 tokens and 1) reuses, from the device and the host"] == 16


def test_a_cache_without_the_host_tier_it_claims_is_found() -> None:
    result = run_check(LocalTarget(kvcache.load(IgnoresOption)), HOST)
    assert (result.status, result.oracle) == ("fail", "count")
    # shrunk to A computed and freed, B pushing its blocks to the host, A again
    assert "admit(A2, 17 tokens [1..16, 22]) reused 12 tokens; the count oracle predicts " \
        "16" in result.message


def test_a_cache_matching_past_its_kept_states_is_found() -> None:
    result = run_check(LocalTarget(kvcache.load(IgnoresOption)), STATES)
    assert (result.status, result.oracle) == ("fail", "count")
    # shrunk: B shares one block of A's, which ends on no kept state (every 2 blocks)
    assert "admit(B, 5 tokens 1..5) reused 4 tokens; the count oracle predicts 0" \
        in result.message


def test_an_engine_without_those_caches_skips_the_families_saying_why() -> None:
    c = sglang_contract("0.5.23", 4)
    for check in (HOST, STATES):
        assert "the adapter opens no cache with" in str(check.skip_reason(c))


def test_the_fuzz_opens_host_tiers_the_oracle_models_exactly() -> None:
    drawn = [fuzz_options(seed, lambda _: ("host_blocks", "state_interval"), 12)
             for seed in range(40)]
    hosts = {o.host_blocks for o in drawn} - {None}
    states = {o.state_interval for o in drawn} - {None}
    assert hosts and hosts <= {24, 36} and states and states <= {1, 2, 3}
    # an engine honouring neither draws neither, and its other options are unchanged
    assert all(fuzz_options(seed, lambda _: ("window",), 12).host_blocks is None
               for seed in range(40))


def test_the_fuzz_never_draws_options_the_adapter_opens_only_apart() -> None:
    """vLLM's adapter opens a window group or a Mamba group beside the full one, not
    both: a cache opened with one does not list the other, and no seed draws both."""
    assert "state_interval" not in honoured(CacheOptions(window=8), "")
    assert "window" not in honoured(CacheOptions(state_interval=2), "")
    assert "state_interval" not in honoured(CacheOptions(), "no Mamba group")
    drawn = [fuzz_options(seed, lambda chosen: honoured(chosen, ""), 12)
             for seed in range(64)]
    assert not [o for o in drawn if o.window is not None and o.state_interval is not None]
    assert any(o.window for o in drawn) and any(o.state_interval for o in drawn)
    # where both are honoured together, a seed draws them together as before
    both = [fuzz_options(seed, lambda _: ("window", "state_interval"), 12)
            for seed in range(64)]
    assert any(o.window and o.state_interval for o in both)


def test_the_fuzz_never_draws_a_window_and_a_chunk_budget_opened_only_apart() -> None:
    """SGLang 0.5.18 opens a window under the tree adapter and a chunk budget under its
    scheduler code: a cache opened with one does not list the other, and no seed draws
    both; where they are honoured together the draws are as before."""
    def apart(chosen: CacheOptions) -> tuple[str, ...]:
        if chosen.window is not None:
            return ("window",)
        return ("chunk_budget",) if chosen.chunk_budget is not None \
            else ("window", "chunk_budget")

    drawn = [fuzz_options(seed, apart, 12) for seed in range(64)]
    assert not [o for o in drawn if o.window is not None and o.chunk_budget is not None]
    assert any(o.window for o in drawn) and any(o.chunk_budget for o in drawn)
    both = [fuzz_options(seed, lambda _: ("window", "chunk_budget"), 12)
            for seed in range(64)]
    assert any(o.window and o.chunk_budget for o in both)
    # the draws do not move: the window (drawn first) is every seed's as before
    assert [o.window for o in drawn] == [o.window for o in both]


def test_a_family_skips_with_the_engines_reason_for_an_option_it_refuses() -> None:
    refused = replace(sglang_contract("0.5.23", 4), citations=(
        ("options", "no state_interval: AssertionError: block_size must be divisible by "
                    "hash_block_size"),))
    assert "; no state_interval: AssertionError: block_size must be divisible" \
        in str(STATES.skip_reason(refused))

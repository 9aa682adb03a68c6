"""Proves different salts or LoRA ids never share blocks (probe_reuse included); one scope does.

Salt 0 is not the default scope and ReuseScope() is; outputs never depend on the scope.
"""

from __future__ import annotations

import pytest

from kvcache import ReuseScope
from tests.scenarios.support import (
    ALL_BACKENDS,
    TORCH,
    BackendSpec,
    EngineFactory,
    ScenarioRun,
    assert_same_outputs,
    forced,
    prompts_of,
)

NEW_TOKENS = 3
# (scope of the cached run, scope of the later run, whether they share)
PAIRS = [
    pytest.param(ReuseScope(salt=1), ReuseScope(salt=1), True, id="same-salt"),
    pytest.param(ReuseScope(salt=1), ReuseScope(salt=2), False, id="other-salt"),
    pytest.param(ReuseScope(salt=0), None, False, id="salt0-vs-default"),
    pytest.param(ReuseScope(), None, True, id="empty-vs-default"),
    pytest.param(ReuseScope(salt="user-a"), ReuseScope(salt=b"user-a"), False,
                 id="str-vs-bytes-salt"),
    pytest.param(ReuseScope(lora_id=3), ReuseScope(lora_id=3), True, id="same-lora"),
    pytest.param(ReuseScope(lora_id=3), ReuseScope(lora_id=4), False, id="other-lora"),
    pytest.param(ReuseScope(salt=1, lora_id=3), ReuseScope(salt=1), False,
                 id="salt-with-vs-without-lora"),
]


@pytest.mark.parametrize(("first", "second", "shares"), PAIRS)
@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (1, 4, 16)])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_scopes_share_only_with_themselves(make_engine: EngineFactory, scenario: ScenarioRun,
                                           backend: BackendSpec, B: int,
                                           first: ReuseScope | None,
                                           second: ReuseScope | None, shares: bool) -> None:
    prompts = prompts_of(B, [9, 21, 40])
    engine = make_engine(B, backend=backend)
    cold = engine.generate(prompts, NEW_TOKENS, [first] * 3)
    want = [len(p) - 1 if shares else 0 for p in prompts]
    assert [engine.manager.probe_reuse(p, second) for p in prompts] == want
    warm = engine.generate(prompts, NEW_TOKENS, [second] * 3,
                           force_tokens=forced(cold, backend))
    assert [o.num_cached_tokens for o in warm] == want
    assert_same_outputs(cold, warm, backend, "other scope vs cold")
    # the first scope's blocks are still there for it, whatever the second did
    assert [engine.manager.probe_reuse(p, first) for p in prompts] == \
        [len(p) - 1 for p in prompts]
    scenario.expect_oracle(engine, cold + warm, seed=B)


@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (4, 16)])
def test_scopes_mixed_in_one_batch(make_engine: EngineFactory, scenario: ScenarioRun,
                                   B: int) -> None:
    """One prompt under four scopes in one batch, twice: each scope reuses only its own."""
    prompt = prompts_of(B, [30])[0]
    scopes = [None, ReuseScope(salt=0), ReuseScope(salt=1), ReuseScope(lora_id=1)]
    engine = make_engine(B)
    cold = engine.generate([prompt] * 4, NEW_TOKENS, scopes)
    assert [o.num_cached_tokens for o in cold] == [0] * 4  # no scope sees another's
    warm = engine.generate([prompt] * 4, NEW_TOKENS, scopes)
    assert [o.num_cached_tokens for o in warm] == [29] * 4
    assert_same_outputs(cold, warm, TORCH, "warm vs cold")
    scenario.expect_oracle(engine, cold + warm, seed=B)

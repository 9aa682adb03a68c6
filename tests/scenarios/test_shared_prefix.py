"""Proves shared system prompts, few-shot prefixes and multi-turn chats reuse exactly right.

Later users reuse the system prompt's blocks, few-shot prompts share prefixes of varying
length, and each chat turn reuses blocks holding earlier generated answers; outputs equal
a run without reuse and reuse equals the oracle.
"""

from __future__ import annotations

import pytest

from harness.workloads import few_shot, multi_turn_conversations, shared_system_prompt
from tests.scenarios.support import (
    ALL_BACKENDS,
    CPU_BACKENDS,
    MODES,
    VOCAB,
    BackendSpec,
    EngineFactory,
    ReuseMode,
    ScenarioRun,
    assert_same_outputs,
    forced,
)

NEW_TOKENS = 4
BLOCKS = [pytest.param(B, id=f"B{B}") for B in (1, 4, 16, 64)]


@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_system_prompt_shared_by_many_users(make_engine: EngineFactory, scenario: ScenarioRun,
                                            backend: BackendSpec, mode: ReuseMode,
                                            B: int) -> None:
    prefix = 37  # ends mid-block for every B but 1
    prompts = shared_system_prompt(5, prefix, 6, vocab=VOCAB, seed=B)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend)
    engine = make_engine(B, backend=backend, mode=mode)
    force = forced(reference, backend)
    first = engine.generate(prompts[:1], NEW_TOKENS, force_tokens=force and force[:1])
    rest = engine.generate(prompts[1:], NEW_TOKENS, force_tokens=force and force[1:])
    assert_same_outputs(reference, first + rest, backend, "shared prefix vs no reuse")
    # every later user reuses the system prompt's full blocks; at most the whole prompt
    for out in rest:
        assert out.kv_metrics is not None
        assert out.kv_metrics.num_full_reused_blocks == prefix // B
        assert prefix // B * B <= out.num_cached_tokens <= prefix
    scenario.expect_oracle(engine, first + rest, seed=B)


@pytest.mark.parametrize("B", BLOCKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_multi_turn_chat_reuses_generated_tokens(make_engine: EngineFactory,
                                                 scenario: ScenarioRun, backend: BackendSpec,
                                                 mode: ReuseMode, B: int) -> None:
    convs = multi_turn_conversations(3, 4, system_len=20, user_len=7, answer_len=0,
                                     vocab=VOCAB, seed=B)
    engine = make_engine(B, backend=backend, mode=mode)
    answers: list[list[list[int]]] = [[] for _ in convs]
    committed: list[int] = []
    for turn in range(4):
        prompts = [c.prompt(turn, answers[i]) for i, c in enumerate(convs)]
        ref = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend)
        outs = engine.generate(prompts, NEW_TOKENS, force_tokens=forced(ref, backend))
        assert_same_outputs(ref, outs, backend, f"turn {turn} vs no reuse")
        if turn:
            # the previous turn committed its prompt and all but its last answer token;
            # that whole run opens this turn's prompt
            want = [n if mode.partial else n // B * B for n in committed]
            assert [o.num_cached_tokens for o in outs] == want, f"turn {turn}"
        committed = [len(p) + NEW_TOKENS - 1 for p in prompts]
        for i, out in enumerate(outs):
            answers[i].append(list(out.token_ids))
        scenario.expect_oracle(engine, outs, seed=B)


@pytest.mark.parametrize("B", [pytest.param(B, id=f"B{B}") for B in (2, 4, 16)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_few_shot_prefixes_of_varying_length(make_engine: EngineFactory, scenario: ScenarioRun,
                                             backend: BackendSpec, mode: ReuseMode,
                                             B: int) -> None:
    prompts = few_shot(8, num_examples=3, example_len=5, query_len=3, vocab=VOCAB, seed=B,
                       pool_size=4)
    reference = make_engine.cold_reference(B, prompts, NEW_TOKENS, backend=backend)
    engine = make_engine(B, backend=backend, mode=mode, max_num_tokens=40)  # waves of ~2
    outs = engine.generate(prompts, NEW_TOKENS, force_tokens=forced(reference, backend))
    assert_same_outputs(reference, outs, backend, "few-shot vs no reuse")
    scenario.expect_oracle(engine, outs, seed=B)

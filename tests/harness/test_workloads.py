"""Workloads: same seed, same prompts; the shapes each workload promises."""

from __future__ import annotations

from typing import Any

import pytest

from harness.workloads import (
    WORKLOADS,
    bench_multi_turn_chat,
    bench_shared_prompt,
    few_shot,
    make_workload,
    multi_turn_chat,
    multi_turn_conversations,
    random_prompt_tree,
    shared_system_prompt,
)

SMALL: dict[str, dict[str, Any]] = {
    "random": {"num_requests": 5, "min_len": 1, "max_len": 9, "vocab": 20},
    "shared_system_prompt": {"num_requests": 6, "prefix_len": 8, "suffix_len": 3,
                             "num_groups": 2, "vocab": 20},
    "multi_turn_chat": {"num_conversations": 3, "turns": 3, "system_len": 5, "user_len": 2,
                        "answer_len": 4, "num_system_prompts": 2, "vocab": 20},
    "few_shot": {"num_requests": 4, "num_examples": 2, "example_len": 3, "query_len": 2,
                 "vocab": 20, "pool_size": 4},
    "random_prompt_tree": {"depth": 3, "branching": 2, "segment_len": 4, "vocab": 20},
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_same_seed_same_prompts_and_ids_in_range(name: str) -> None:
    a = make_workload(name, seed=5, **SMALL[name])
    assert a == make_workload(name, seed=5, **SMALL[name])
    assert a != make_workload(name, seed=6, **SMALL[name])
    assert all(p and all(1 <= t < 20 for t in p) for p in a)


def test_registry_lists_names_on_unknown() -> None:
    assert set(SMALL) | {"bench_shared_prompt", "bench_multi_turn_chat"} == set(WORKLOADS)
    with pytest.raises(ValueError, match="unknown workload 'chat'; known: bench_multi_turn_chat"):
        make_workload("chat")


def test_shared_system_prompt_groups() -> None:
    prompts = shared_system_prompt(6, 8, 3, num_groups=2, vocab=20, seed=1)
    assert [len(p) for p in prompts] == [11] * 6
    assert prompts[0][:8] == prompts[2][:8] == prompts[4][:8] != prompts[1][:8]
    assert prompts[1][:8] == prompts[3][:8]


def test_multi_turn_chat_is_turn_major_and_grows() -> None:
    prompts = multi_turn_chat(3, 3, 5, 2, 4, num_system_prompts=2, vocab=20, seed=1)
    convs = multi_turn_conversations(3, 3, 5, 2, 4, num_system_prompts=2, vocab=20, seed=1)
    assert len(prompts) == 9
    assert [len(p) for p in prompts] == [7] * 3 + [13] * 3 + [19] * 3  # +4 answer +2 user
    for t in range(1, 3):
        for c in range(3):
            prev, cur = prompts[(t - 1) * 3 + c], prompts[t * 3 + c]
            assert cur[: len(prev)] == prev
            assert cur == convs[c].prompt(t)
            assert cur[len(prev):len(prev) + 4] == list(convs[c].answers[t - 1])
    assert convs[0].system == convs[2].system != convs[1].system


def test_conversation_takes_real_answers() -> None:
    conv = multi_turn_conversations(1, 2, 3, 2, 4, vocab=20, seed=1)[0]
    assert conv.prompt(1, answers=[[9, 9]]) == [*conv.system, *conv.users[0], 9, 9,
                                                *conv.users[1]]
    with pytest.raises(ValueError, match="turn 2 out of range"):
        conv.prompt(2)
    with pytest.raises(ValueError, match="turn 1 needs 1 answers, got 0"):
        conv.prompt(1, answers=[])


def test_few_shot_shared_and_pooled() -> None:
    shared = few_shot(3, 2, 3, 2, vocab=20, seed=1)
    assert len({tuple(p[:6]) for p in shared}) == 1 and all(len(p) == 8 for p in shared)
    pooled = few_shot(20, 2, 3, 2, vocab=20, seed=1, pool_size=4)
    assert len({tuple(p[:6]) for p in pooled}) > 1
    with pytest.raises(ValueError, match="pool_size must be an int >= 2, got 1"):
        few_shot(1, 2, 3, 2, pool_size=1)


def _shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def test_random_prompt_tree_shape() -> None:
    # depth 3, branching 2: 4 leaves; all share the root segment, siblings share more
    p = random_prompt_tree(3, depth=3, branching=2, segment_len=4, vocab=20)
    assert len(p) == 4
    root = _shared(p[0], p[3])
    assert 1 <= root == _shared(p[1], p[2]) < min(_shared(p[0], p[1]), _shared(p[2], p[3]))


def test_bench_workloads_as_design_specifies() -> None:
    shared = bench_shared_prompt()
    assert len(shared) == 1000 and {len(p) for p in shared} == {2048}
    assert shared[0][:1536] == shared[10][:1536] != shared[1][:1536]
    assert shared[0][1536:] != shared[10][1536:]
    assert all(min(p) >= 1 and max(p) < 50_000 for p in shared[:20])
    chat = bench_multi_turn_chat()
    assert len(chat) == 1600
    # turn t of conversation c is chat[t * 200 + c]: 256 + 64 + t * (128 + 64) tokens
    assert [len(chat[t * 200]) for t in range(8)] == [320 + 192 * t for t in range(8)]
    assert chat[200 + 7][:320] == chat[7] and chat[7][:256] == chat[17][:256]
    assert chat[7][:256] != chat[8][:256]
    assert bench_shared_prompt()[999] == shared[999]  # a fixed seed: reproducible


@pytest.mark.parametrize(("name", "params", "message"), [
    pytest.param("random", {"num_requests": 1, "min_len": 0, "max_len": 3},
                 "min_len must be an int >= 1, got 0", id="min-len"),
    pytest.param("random", {"num_requests": 1, "min_len": 4, "max_len": 3},
                 "max_len must be an int >= 4, got 3", id="max-len"),
    pytest.param("shared_system_prompt", {"num_requests": 1, "prefix_len": 2, "suffix_len": 1,
                                          "vocab": 1}, "vocab must be an int >= 2", id="vocab"),
    pytest.param("multi_turn_chat", {"num_conversations": 1, "turns": 0, "system_len": 1,
                                     "user_len": 1, "answer_len": 1}, "turns must be",
                 id="turns"),
])
def test_bad_parameters(name: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_workload(name, **params)

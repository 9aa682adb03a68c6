"""Reproducible prompt sets: shared system prompt, multi-turn chat, few-shot, prompt trees.

Every workload draws from `random.Random(seed)` only, so the same arguments give the same
prompts on any machine. Token ids lie in [1, vocab) (0 is left for padding). Workloads are
looked up by name through `make_workload`, whose error lists the names.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

Prompt = list[int]
BENCH_SEED = 0
BENCH_VOCAB = 50_000


def _check(where: str, **values: tuple[Any, int]) -> None:
    """Each keyword is (value, minimum); raises ValueError naming the first bad one."""
    for name, (value, low) in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{where}: {name} must be an int >= {low}, got {value!r}")


def _draw(rng: random.Random, n: int, vocab: int) -> Prompt:
    return rng.choices(range(1, vocab), k=n)


def random_prompts(num_requests: int, min_len: int, max_len: int, vocab: int = 1000,
                   seed: int = 0) -> list[Prompt]:
    """Independent prompts with lengths uniform in [min_len, max_len] (min_len >= 1)."""
    _check("random_prompts", num_requests=(num_requests, 0), min_len=(min_len, 1),
           vocab=(vocab, 2))
    _check("random_prompts", max_len=(max_len, min_len))
    rng = random.Random(seed)
    return [_draw(rng, rng.randint(min_len, max_len), vocab) for _ in range(num_requests)]


def shared_system_prompt(num_requests: int, prefix_len: int, suffix_len: int,
                         num_groups: int = 1, vocab: int = 1000, seed: int = 0
                         ) -> list[Prompt]:
    """Request i = system prompt of group i % num_groups + suffix_len unique tokens."""
    _check("shared_system_prompt", num_requests=(num_requests, 0), prefix_len=(prefix_len, 0),
           suffix_len=(suffix_len, 0), num_groups=(num_groups, 1), vocab=(vocab, 2))
    rng = random.Random(seed)
    systems = [_draw(rng, prefix_len, vocab) for _ in range(num_groups)]
    return [systems[i % num_groups] + _draw(rng, suffix_len, vocab)
            for i in range(num_requests)]


@dataclass(frozen=True)
class Conversation:
    """One chat: a system prompt, a user message per turn, a placeholder answer per turn.

    The placeholder answers stand in for generated tokens: a scenario with a real model
    passes the tokens it generated to `prompt` instead.
    """

    system: tuple[int, ...]
    users: tuple[tuple[int, ...], ...]
    answers: tuple[tuple[int, ...], ...]

    def prompt(self, turn: int, answers: Sequence[Sequence[int]] | None = None) -> Prompt:
        """Turn `turn`'s prompt: system + user 0 + answer 0 + ... + user `turn`.

        `answers[t]` replaces placeholder answer t (t < turn). Raises ValueError for a
        turn out of range or too few answers.
        """
        if not 0 <= turn < len(self.users):
            raise ValueError(f"turn {turn} out of range [0, {len(self.users)})")
        given = self.answers if answers is None else answers
        if len(given) < turn:
            raise ValueError(f"turn {turn} needs {turn} answers, got {len(given)}")
        out = list(self.system)
        for t in range(turn):
            out += self.users[t]
            out += given[t]
        return out + list(self.users[turn])


def multi_turn_conversations(num_conversations: int, turns: int, system_len: int,
                             user_len: int, answer_len: int, num_system_prompts: int = 1,
                             vocab: int = 1000, seed: int = 0) -> list[Conversation]:
    """Conversation c uses system prompt c % num_system_prompts; see `Conversation`."""
    _check("multi_turn_conversations", num_conversations=(num_conversations, 0),
           turns=(turns, 1), system_len=(system_len, 0), user_len=(user_len, 0),
           answer_len=(answer_len, 0), num_system_prompts=(num_system_prompts, 1),
           vocab=(vocab, 2))
    rng = random.Random(seed)
    systems = [tuple(_draw(rng, system_len, vocab)) for _ in range(num_system_prompts)]
    out = []
    for c in range(num_conversations):
        users = tuple(tuple(_draw(rng, user_len, vocab)) for _ in range(turns))
        answers = tuple(tuple(_draw(rng, answer_len, vocab)) for _ in range(turns - 1))
        out.append(Conversation(systems[c % num_system_prompts], users, answers))
    return out


def multi_turn_chat(num_conversations: int, turns: int, system_len: int, user_len: int,
                    answer_len: int, num_system_prompts: int = 1, vocab: int = 1000,
                    seed: int = 0) -> list[Prompt]:
    """Every turn's prompt, turn-major (all first turns, then all second turns, ...).

    Turn t's prompt = turn t-1's prompt + placeholder answer (answer_len tokens standing
    in for generated ones) + user_len new user tokens.
    """
    convs = multi_turn_conversations(num_conversations, turns, system_len, user_len,
                                     answer_len, num_system_prompts, vocab, seed)
    prompts: list[Prompt] = []
    current = [list(c.system) + list(c.users[0]) for c in convs]
    for t in range(turns):
        if t:
            current = [p + list(c.answers[t - 1]) + list(c.users[t])
                       for p, c in zip(current, convs, strict=True)]
        prompts += current
    return prompts


def few_shot(num_requests: int, num_examples: int, example_len: int, query_len: int,
             vocab: int = 1000, seed: int = 0, pool_size: int | None = None) -> list[Prompt]:
    """num_examples examples + a unique query per request.

    Without `pool_size` every request shows the same examples in the same order (one
    shared prefix). With it, each request draws its examples in random order from a pool
    of `pool_size`, so requests share prefixes of varying length.
    """
    pool = num_examples if pool_size is None else pool_size
    _check("few_shot", num_requests=(num_requests, 0), num_examples=(num_examples, 0),
           example_len=(example_len, 0), query_len=(query_len, 0), vocab=(vocab, 2))
    _check("few_shot", pool_size=(pool, num_examples))
    rng = random.Random(seed)
    examples = [_draw(rng, example_len, vocab) for _ in range(pool)]
    prompts = []
    for _ in range(num_requests):
        picked = range(num_examples) if pool_size is None else rng.sample(range(pool),
                                                                          num_examples)
        prompts.append([t for i in picked for t in examples[i]] + _draw(rng, query_len, vocab))
    return prompts


def random_prompt_tree(seed: int, depth: int, branching: int, segment_len: int,
                       vocab: int = 1000) -> list[Prompt]:
    """Root-to-leaf paths of a random tree of token segments, depth-first.

    Each node holds a segment of 1..segment_len tokens (uniform, so branch points fall
    anywhere in a block); every node below the root has `branching` children down to
    `depth` levels, giving branching ** (depth - 1) prompts.
    """
    _check("random_prompt_tree", seed=(seed, 0), depth=(depth, 1), branching=(branching, 1),
           segment_len=(segment_len, 1), vocab=(vocab, 2))
    rng = random.Random(seed)

    def grow(prefix: Prompt, level: int) -> list[Prompt]:
        path = prefix + _draw(rng, rng.randint(1, segment_len), vocab)
        if level == depth:
            return [path]
        return [p for _ in range(branching) for p in grow(path, level + 1)]

    return grow([], 1)


def bench_shared_prompt(seed: int = BENCH_SEED) -> list[Prompt]:
    """Cache-core benchmark workload (docs/design.md): 1,000 requests of 2,048 tokens, ids
    in [1, 50000); request i = the 1,536-token prompt of group i % 10 + 512 unique tokens."""
    return shared_system_prompt(1000, 1536, 512, 10, BENCH_VOCAB, seed)


def bench_multi_turn_chat(seed: int = BENCH_SEED) -> list[Prompt]:
    """Cache-core benchmark workload (docs/design.md): 200 conversations x 8 turns,
    turn-major; system prompt c % 10 (256 tokens) + 64 user tokens, then 128 generated + 64
    user per turn."""
    return multi_turn_chat(200, 8, 256, 64, 128, 10, BENCH_VOCAB, seed)


WORKLOADS: Mapping[str, Callable[..., list[Prompt]]] = MappingProxyType({
    "random": random_prompts,
    "shared_system_prompt": shared_system_prompt,
    "multi_turn_chat": multi_turn_chat,
    "few_shot": few_shot,
    "random_prompt_tree": random_prompt_tree,
    "bench_shared_prompt": bench_shared_prompt,
    "bench_multi_turn_chat": bench_multi_turn_chat,
})


def make_workload(name: str, **params: Any) -> list[Prompt]:
    """Build workload `name` with `params`. Raises ValueError for an unknown name."""
    fn = WORKLOADS.get(name)
    if fn is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    return fn(**params)


def bench_random_tree() -> list[Prompt]:
    """The cache benchmarks' branching workload: 6**3 = 216 root-to-leaf paths of four
    256-token segments, with branch points anywhere inside blocks (many splits)."""
    return random_prompt_tree(7, depth=4, branching=6, segment_len=256, vocab=BENCH_VOCAB)


# The cache-level benchmarks' workloads by name: benchmarks/test_bench_cache_core.py and
# kvharness conform --bench measure the same prompts.
CACHE_BENCH_WORKLOADS: Mapping[str, Callable[[], list[Prompt]]] = MappingProxyType({
    "shared_prompt": bench_shared_prompt,
    "multi_turn": bench_multi_turn_chat,
    "random_tree": bench_random_tree,
})

"""Fuzz: warm equals cold on random workloads, each reproducible from its seed.

A seed draws a prompt tree (prompts extend cut-off prefixes of earlier ones), a block
size, a token budget, a pool from barely-enough to roomy, batch size, reuse flags and
scopes, then runs the prompts in waves on one engine. Every output must equal a cold run
(reuse off, nothing preempted), nothing may leak, after every step usedNumBlocks must be
what the live requests need (capacity oracle), every read of every forward pass must find
the reader's own KV (provenance oracle, replaying the log), and where nothing was evicted
the reuse counters must equal the oracle's. The test id is the seed; a failure prints the
workload and the command that replays it.

The window seeds run the same workloads on a model whose attention has a sliding window
of 2 to 8 tokens, on every layer (the cache releases what no window reaches: early
release, chunked windowed admissions, the batch cutting released pages), on some layers
beside full-attention ones (one backend per window, full bookkeeping), or beside a
recurrent layer (release, and reuse from state snapshots). Their cold run releases
nothing, so no release logic is in the reference.

The host seeds run the same workloads with a host tier of 1 to 4x the device pool behind
it, on the tiny model, on the hybrid one (whose state snapshots must follow their blocks
to the host and back) or on a window seed's model (full bookkeeping beside a host tier).

`test_warm_equals_cold_quick`, `..._window_quick` and `..._host_quick` (10 seeds each) are
for pre-merge; `test_warm_equals_cold_full`, `..._window_full` and `..._host_full` (500,
1,000 and 500 other seeds, marked slow) for post-merge.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

from harness.reuse.assertions import predict_from_engine
from kvcache import GenerationOutput, ReuseScope
from kvcache.engine import FinishReason
from kvcache.model import ModelConfig, Transformer, get_preset
from tests.reliability.support import (
    LOGITS_ATOL,
    EngineSpec,
    assert_clean,
    assert_provenance,
    assert_same_output,
    assert_same_outputs,
    cold_outputs,
    generate_checked,
)

Prompt = tuple[int, ...]
QUICK_SEEDS = range(10)
FULL_SEEDS = range(10, 510)
WINDOW_QUICK_SEEDS = range(10)
WINDOW_FULL_SEEDS = range(10, 1010)
HOST_QUICK_SEEDS = range(10)
HOST_FULL_SEEDS = range(10, 510)


@dataclass(frozen=True)
class FuzzCase:
    """One random workload: engine settings and waves of (prompt, scope)."""

    seed: int
    spec: EngineSpec
    waves: tuple[tuple[tuple[Prompt, ReuseScope | None], ...], ...]
    max_new_tokens: int

    def describe(self) -> str:
        lines = [f"seed {self.seed}: {self.spec}, max_new_tokens={self.max_new_tokens}"]
        for i, wave in enumerate(self.waves):
            lines += [f"  wave {i}: {list(p)} scope={s}" for p, s in wave]
        return "\n".join(lines)


def prompt_tree(rng: random.Random) -> list[Prompt]:
    """Prompts over a small alphabet; most extend a cut-off prefix of an earlier one."""
    prompts: list[Prompt] = []
    for _ in range(rng.randint(2, 7)):
        base: Prompt = ()
        if prompts and rng.random() < 0.75:
            parent = rng.choice(prompts)
            base = parent[:rng.randint(0, len(parent))]
        extra = tuple(rng.randrange(1, 30) for _ in range(rng.randint(1, 8)))
        prompts.append((base + extra)[:20])
    return prompts


def make_case(seed: int) -> FuzzCase:
    """The workload of `seed` (pure function of the seed)."""
    rng = random.Random(seed)
    B = rng.choice([1, 2, 3, 4, 8])
    prompts = prompt_tree(rng)
    new = rng.randint(1, 4)
    need = max(-(-(len(p) + new) // B) for p in prompts)
    # From exactly the largest request's need (a partial copy then forgoes its source)
    # to roomy pools.
    pool = rng.choice([need, need + 1, need + 2, 2 * need + 1, 4 * need + 8])
    chunked = rng.random() < 0.85
    budget = rng.choice([1, 2, 3, 5, 8, 16, 64])
    if not chunked:
        budget = max(budget, max(len(p) + new for p in prompts))
    reuse, partial, copy = rng.choice([(None, None, None), (True, True, False),
                                       (True, False, None), (False, None, None)])
    spec = EngineSpec(B, pool, max_num_tokens=budget, max_batch_size=rng.choice([1, 2, 4, 8]),
                      chunked=chunked, reuse=reuse, partial=partial, copy=copy)
    scopes = [None, None, ReuseScope(salt=1)]
    waves = tuple(
        tuple((rng.choice(prompts), rng.choice(scopes)) for _ in range(rng.randint(1, 5)))
        for _ in range(rng.randint(1, 4)))
    return FuzzCase(seed, spec, waves, new)


class CaseCounts(NamedTuple):
    """What one case put through the oracles: engine steps (each followed by the capacity
    check), cache events and KV slots the provenance oracle checked."""

    steps: int
    events: int
    slots_checked: int


def check_case(model: Transformer, case: FuzzCase) -> CaseCounts:
    distinct = sorted({p for wave in case.waves for p, _ in wave})
    cold = dict(zip(distinct, cold_outputs(model, [list(p) for p in distinct],
                                           case.max_new_tokens), strict=True))
    engine = case.spec.build(model)
    steps = 0
    for i, wave in enumerate(case.waves):
        outs, n = generate_checked(engine, [list(p) for p, _ in wave], case.max_new_tokens,
                                   [s for _, s in wave])
        steps += n
        assert_same_outputs([cold[p] for p, _ in wave], outs, f"wave {i}")
        assert_clean(engine.manager, f"after wave {i}")
    shadow = assert_provenance(engine)
    stats = engine.kv_cache_stats()
    if stats.evicted_blocks == 0:  # the oracle is exact when nothing was evicted
        predicted = predict_from_engine(engine)
        assert (predicted.totals.reused_blocks, predicted.totals.missed_blocks) == (
            stats.reused_blocks, stats.missed_blocks), "reuse counters differ from the oracle"
    return CaseCounts(steps, shadow.num_events, shadow.num_slots_checked)


def run_case(model: Transformer, case: FuzzCase, what: str, node_id: str) -> None:
    """`check_case`; a failure names `what` ran, the workload and the replay command."""
    try:
        check_case(model, case)
    except AssertionError as exc:
        raise AssertionError(f"{what} failed: {exc}\n{case.describe()}\n"
                             f"replay: pytest '{node_id}'") from exc


def run_seed(model: Transformer, seed: int, node_id: str) -> None:
    run_case(model, make_case(seed), f"fuzz seed {seed}", node_id)


def for_model(case: FuzzCase, config: ModelConfig) -> FuzzCase:
    """`case`, with partial reuse left to the engine for a recurrent model (which refuses
    it when asked for explicitly)."""
    if not (config.has_recurrent_layers and case.spec.partial):
        return case
    return dataclasses.replace(case, spec=dataclasses.replace(case.spec, partial=None,
                                                              copy=None))


def window_model_of(seed: int) -> ModelConfig:
    """Window seed `seed`'s model: the tiny shape with a window of 2 to 8 tokens on every
    attention layer; a third of the seeds make a random nonempty subset of the layers
    full-attention instead, another third make layer 1 recurrent (hybrid-tiny's layout)."""
    rng = random.Random(-1 - seed)
    window = rng.randint(2, 8)
    base = get_preset("tiny")
    kinds = ["attention"] * base.num_layers
    draw = rng.random()
    if draw < 1 / 3:
        full = rng.sample(range(base.num_layers), rng.randint(1, base.num_layers - 1))
        kinds = ["full_attention" if i in full else "attention" for i in range(base.num_layers)]
    elif draw < 2 / 3:
        kinds = list(get_preset("hybrid-tiny").layer_types)
    return dataclasses.replace(base, sliding_window=window, layer_types=tuple(kinds))


def run_window_seed(seed: int, node_id: str) -> None:
    config = window_model_of(seed)
    run_case(Transformer(config, seed=0), for_model(make_case(seed), config),
             f"window fuzz seed {seed} (window {config.sliding_window}, layers "
             f"{config.layer_types})", node_id)


def host_case_of(seed: int) -> tuple[ModelConfig, FuzzCase]:
    """Host seed `seed`: the tiny model, the hybrid one or a window seed's model (whose
    cache keeps full-attention bookkeeping beside a host tier), and the workload of
    `seed` with a host tier of 1 block to 4x the device pool (reuse on: the host caches
    what reuse caches; partial reuse left to the engine, which a hybrid model needs)."""
    rng = random.Random(10_000 + seed)
    kind = rng.choice(["tiny", "hybrid-tiny", "window"])
    config = window_model_of(seed) if kind == "window" else get_preset(kind)
    case = make_case(seed)
    spec = case.spec
    host = rng.choice([1, spec.max_num_blocks, 2 * spec.max_num_blocks,
                       4 * spec.max_num_blocks])
    spec = dataclasses.replace(spec, host=host, reuse=None if spec.reuse is False else spec.reuse)
    return config, for_model(dataclasses.replace(case, spec=spec), config)


def run_host_seed(seed: int, node_id: str) -> None:
    config, case = host_case_of(seed)
    run_case(Transformer(config, seed=0), case, f"host fuzz seed {seed} (window "
             f"{config.sliding_window}, layers {config.layer_types})", node_id)


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"s{s:03d}") for s in QUICK_SEEDS])
def test_warm_equals_cold_quick(tiny_model: Transformer, seed: int,
                                request: pytest.FixtureRequest) -> None:
    run_seed(tiny_model, seed, request.node.nodeid)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"s{s:03d}") for s in FULL_SEEDS])
def test_warm_equals_cold_full(tiny_model: Transformer, seed: int,
                               request: pytest.FixtureRequest) -> None:
    run_seed(tiny_model, seed, request.node.nodeid)


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"w{s:03d}") for s in WINDOW_QUICK_SEEDS])
def test_warm_equals_cold_window_quick(seed: int, request: pytest.FixtureRequest) -> None:
    run_window_seed(seed, request.node.nodeid)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"w{s:03d}") for s in WINDOW_FULL_SEEDS])
def test_warm_equals_cold_window_full(seed: int, request: pytest.FixtureRequest) -> None:
    run_window_seed(seed, request.node.nodeid)


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"h{s:03d}") for s in HOST_QUICK_SEEDS])
def test_warm_equals_cold_host_quick(seed: int, request: pytest.FixtureRequest) -> None:
    run_host_seed(seed, request.node.nodeid)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"h{s:03d}") for s in HOST_FULL_SEEDS])
def test_warm_equals_cold_host_full(seed: int, request: pytest.FixtureRequest) -> None:
    run_host_seed(seed, request.node.nodeid)


def test_the_host_seeds_cover_every_model_and_tight_hosts() -> None:
    """Each slice reaches the tiny, the hybrid and a windowed model, a one-block host and
    one 4x the device pool."""
    for seeds in (HOST_QUICK_SEEDS, HOST_FULL_SEEDS):
        cases = [host_case_of(s) for s in seeds]
        assert {c.has_recurrent_layers for c, _ in cases} == {False, True}
        assert {c.sliding_window is None for c, _ in cases} == {False, True}
        assert any(case.spec.host == 1 for _, case in cases)
        assert any(case.spec.host == 4 * case.spec.max_num_blocks for _, case in cases)


def test_the_window_seeds_cover_every_kind_of_model() -> None:
    """The quick slice and the full run each reach all-windowed, mixed and hybrid models,
    windows shorter and longer than a block, and prompts longer than their window."""
    for seeds in (WINDOW_QUICK_SEEDS, WINDOW_FULL_SEEDS):
        configs = [(c := window_model_of(s), for_model(make_case(s), c)) for s in seeds]
        assert any(c.shared_window is not None and not c.has_recurrent_layers
                   for c, _ in configs)
        assert any(c.shared_window is None for c, _ in configs)
        assert any(c.has_recurrent_layers for c, _ in configs)
        assert any(c.sliding_window is not None and c.sliding_window < case.spec.tokens_per_block
                   for c, case in configs)
        assert any(c.sliding_window is not None and c.sliding_window > case.spec.tokens_per_block
                   for c, case in configs)
        assert any(max(len(p) for w in case.waves for p, _ in w) > 2 * (c.sliding_window or 0)
                   for c, case in configs)


def _output(tokens: list[int], logits: list[list[float]]) -> GenerationOutput:
    return GenerationOutput(0, (1, 2), tokens, torch.tensor(logits), 0, None,
                            FinishReason.LENGTH)


def test_greedy_runs_may_part_only_at_a_near_tie() -> None:
    """The comparison every fuzz case ends with: equal tokens and logits, or a parting at
    a step where the cold run's logits of both tokens are within 2 * LOGITS_ATOL (window
    seed 376: 4e-7 apart in a hybrid model, where the scan's rounding picks either).
    Logits must agree up to the parting step; nothing after it is compared."""
    tie = 0.5 * LOGITS_ATOL
    cold = _output([0, 1], [[1.0 + tie, 1.0, 0.0], [0.0, 2.0, 0.0]])
    assert_same_output(cold, _output([0, 1], [[1.0 + tie, 1.0, 0.0], [0.0, 2.0, 0.0]]), "same")
    assert_same_output(cold, _output([1, 2], [[1.0, 1.0 + tie, 0.0], [0.0, 0.0, 9.0]]), "tie")
    clear = _output([0, 1], [[1.1, 1.0, 0.0], [0.0, 2.0, 0.0]])
    with pytest.raises(AssertionError, match=r"generated \[1, 2\], the cold run \[0, 1\]"):
        assert_same_output(clear, _output([1, 2], [[1.1, 1.0, 0.0], [0.0, 0.0, 9.0]]), "gap")
    with pytest.raises(AssertionError, match="logits differ from the cold run"):
        assert_same_output(cold, _output([0, 1], [[1.0, 1.0, 0.0], [0.0, 2.5, 0.0]]), "drift")
    with pytest.raises(AssertionError, match=r"generated \[0\], the cold run \[0, 1\]"):
        assert_same_output(cold, _output([0], [[1.0 + tie, 1.0, 0.0]]), "short")
    with pytest.raises(AssertionError, match="generated 1 tokens, the cold run 2"):
        assert_same_output(cold, _output([1], [[1.0, 1.0 + tie, 0.0]]), "parted, short")


def test_a_seed_always_draws_the_same_workload() -> None:
    assert make_case(1234) == make_case(1234)
    assert make_case(1234) != make_case(1235)


def test_the_seeds_cover_the_settings_that_matter() -> None:
    """The quick slice and the full run each reach every block size, tight and roomy
    pools, unchunked prefill, several scopes and every reuse policy."""
    for seeds in (QUICK_SEEDS, FULL_SEEDS):
        cases = [make_case(s) for s in seeds]
        assert {c.spec.tokens_per_block for c in cases} >= ({1, 2, 4} if len(cases) < 50
                                                             else {1, 2, 3, 4, 8})
        assert any(not c.spec.chunked for c in cases) or len(cases) < 50
        assert any(len({s for w in c.waves for _, s in w}) > 1 for c in cases)
        assert len({(c.spec.reuse, c.spec.partial) for c in cases}) >= 3

"""Step-overhead budget: one step of the real engine on the tiny model (CPU), phase by phase.

A StepTimer attached to the Engine splits every timed step into schedule, metadata, plan,
forward, sample and commit (see kvcache.engine.step_timer); pytest-benchmark times the
same `Engine.step` calls. The overhead is everything but the forward, as a fraction of
the step (per-phase medians, so one slow forward on a busy VM does not hide it). Target
(issue 17): at most 10% at decode batch 64.

Decode: `batch` requests with distinct CONTEXT-token prompts, prefilled and warmed up
untimed, then every timed step decodes one token for each of them. Prefill with
chunking: prompts of PREFILL_LEN tokens under a per-step budget of PREFILL_BUDGET, one
token generated each, so every timed step computes a full budget of prompt chunks
(one or two requests); fresh prompts are queued untimed when the last ones finish.
The decode at batch 64 runs again on `tiny-mixed-swa` (full-attention layers interleaved
with 32-token-window ones: two backends planned per step) against `tiny`'s, same run.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from benchmarks.report_format import Section, by_suite, duration, table
from harness.reports.bench_results import Benchmark
from kvcache import Engine, KvCacheConfig
from kvcache.engine.step_timer import PHASES, StepTimer
from kvcache.model import get_preset

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PRESET, BLOCK, SEED = "tiny", 16, 0
MIXED = "tiny-mixed-swa"
OVERHEAD_TARGET = 0.10  # issue 17: at decode batch 64, at most 10% of the step
TARGET_BATCH = 64


@dataclass(frozen=True)
class StepPlan:
    """Sizes and rounds of one run mode."""

    context: int  # decode: prompt tokens of each request
    decode_warmup: int
    decode_rounds: int
    prefill_len: int
    prefill_budget: int
    prefill_rounds: int


FULL = StepPlan(context=128, decode_warmup=2, decode_rounds=9, prefill_len=768,
                prefill_budget=512, prefill_rounds=12)
QUICK = StepPlan(context=32, decode_warmup=1, decode_rounds=2, prefill_len=192,
                 prefill_budget=128, prefill_rounds=3)


@pytest.fixture(scope="module")
def plan(bench_quick: bool) -> StepPlan:
    return QUICK if bench_quick else FULL


def prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    """`n` random prompts that share no block (so nothing is reused)."""
    vocab = get_preset(PRESET).vocab_size
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def engine_for(batch: int, tokens_per_request: int, budget: int,
               preset: str = PRESET) -> Engine:
    blocks = batch * (-(-tokens_per_request // BLOCK) + 1) + 8
    cfg = KvCacheConfig(tokens_per_block=BLOCK, max_num_blocks=blocks)
    return Engine(preset, cfg, max_num_tokens=budget, max_batch_size=batch, seed=SEED,
                  record_events=False)


def record(benchmark: Any, timer: StepTimer, model: str = PRESET, **info: Any) -> None:
    """Per-phase medians (us) and their fractions of the step, into extra_info."""
    medians = {p: statistics.median(getattr(s, p) for s in timer.steps) for p in PHASES}
    step = sum(medians.values())
    benchmark.extra_info.update(
        suite="step", model=model, block_size=BLOCK, steps=len(timer.steps),
        torch_num_threads=torch.get_num_threads(),
        phase_us={p: round(t * 1e6, 2) for p, t in medians.items()},
        phase_fraction={p: round(t / step, 5) for p, t in medians.items()},
        step_us=round(step * 1e6, 2), overhead_fraction=round(1 - medians["forward"] / step, 5),
        **info)


@pytest.mark.parametrize(("preset", "batch"), [
    *(pytest.param(PRESET, b, id=f"b{b}") for b in (1, 64, 256)),
    pytest.param(MIXED, TARGET_BATCH, id=f"mixed-windows-b{TARGET_BATCH}")])
def test_decode_step(benchmark: Any, plan: StepPlan, preset: str, batch: int) -> None:
    """One decode token for each of `batch` running requests."""
    rounds, warmup = plan.decode_rounds, plan.decode_warmup
    new_tokens = 1 + warmup + rounds + 1  # prefill, warm-up, timed; none finishes in a round
    engine = engine_for(batch, plan.context + new_tokens, budget=max(batch * plan.context, 512),
                        preset=preset)
    for p in prompts(random.Random(SEED), batch, plan.context):
        engine.add_request(p, max_new_tokens=new_tokens, return_logits=False)
    for _ in range(warmup + 1):  # the prefill, then decodes to warm up
        engine.step()
    timer = StepTimer()
    engine.step_timer = timer
    before = engine.num_computed_tokens
    benchmark.pedantic(engine.step, rounds=rounds, iterations=1)
    assert len(timer.steps) == rounds
    assert engine.num_computed_tokens - before == batch * rounds, "a timed step was not a decode"
    assert len(engine.scheduler.running) == batch
    target = OVERHEAD_TARGET if batch == TARGET_BATCH and preset == PRESET else None
    record(benchmark, timer, preset, kind="decode", batch=batch, context=plan.context,
           target=target)


def test_prefill_step(benchmark: Any, plan: StepPlan) -> None:
    """Chunked prefill: every step computes a full budget of prompt chunks."""
    L, budget = plan.prefill_len, plan.prefill_budget
    n = 4  # requests queued at a time; they span 4L / budget steps
    engine = engine_for(n, L + 1, budget)
    rng = random.Random(SEED)

    def refill() -> None:
        if not engine.has_unfinished():
            for p in prompts(rng, n, L):
                engine.add_request(p, max_new_tokens=1, return_logits=False)

    refill()
    engine.step()  # warm-up
    timer = StepTimer()
    engine.step_timer = timer
    before = engine.num_computed_tokens
    benchmark.pedantic(engine.step, setup=refill, rounds=plan.prefill_rounds, iterations=1)
    assert len(timer.steps) == plan.prefill_rounds
    assert engine.num_computed_tokens - before == budget * plan.prefill_rounds, \
        "a timed step computed less than a full budget"
    record(benchmark, timer, kind="prefill", batch=n, prompt_tokens=L, budget=budget)


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --

STEP_PHASES = ("schedule", "metadata", "plan", "forward", "sample", "commit")  # columns


def _step(benches: Sequence[Benchmark]) -> list[str]:
    rows, lines = [], []
    for b in sorted(benches, key=lambda b: (b.extra["kind"] != "decode", b.extra["batch"],
                                            b.extra.get("model", ""))):
        e = b.extra
        phases = e["phase_us"]
        size = (f"{e['context']}-token contexts" if e["kind"] == "decode"
                else f"{e['prompt_tokens']}-token prompts, {e['budget']} a step")
        kind = f"{e['kind']} ({e['model']})" if "model" in e else e["kind"]
        rows.append([kind, e["batch"], size,
                     duration(e["step_us"] / 1e6),
                     *(duration(phases[p] / 1e6) for p in STEP_PHASES),
                     f"{e['overhead_fraction']:.1%}"])
        if e.get("target") is not None:
            lines.append(f"Not forward at decode batch {e['batch']}: **{e['overhead_fraction']:.1%}** "
                         f"of the step (target <= {e['target']:.0%}).")
    return ["## Step overhead: one engine step of the tiny model by phase (medians)", "",
            *table(["step", "batch", "size", "step", *STEP_PHASES, "not forward"], rows),
            *lines, ""]


SECTIONS = (
    Section("Step overhead", by_suite("step"), _step),
)

"""The engine's metadata, kept across steps by its PersistentBatch, equals a full rebuild
from the block table at every step: admissions, aborts, finishes, preemptions, chunked
prefills, re-paging and decode padding."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from kvcache import Engine, KvCacheConfig
from kvcache.attention.metadata import PagedMetadata, build_metadata
from kvcache.engine import GenerationOutput
from kvcache.engine.step_records import Schedule
from tests.unit.attention.support import assert_same_metadata


class RebuildCheck:
    """Wraps the engine's scheduler.schedule and backend.plan (both still run): every
    planned metadata is compared with build_metadata over the step's chunks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kinds: Counter[str] = Counter()
        self._schedule = engine.scheduler.schedule
        self._plan = engine.backend.plan
        self._last: Schedule | None = None
        engine.scheduler.schedule = self.schedule  # type: ignore[method-assign]
        engine.backend.plan = self.plan  # type: ignore[method-assign]

    def schedule(self) -> Schedule:
        self._last = self._schedule()
        return self._last

    def plan(self, md: PagedMetadata) -> None:
        e = self.engine
        assert self._last is not None
        chunks = self._last.chunks
        want = build_metadata(
            e.table, [c.req.slot for c in chunks], [c.req.num_computed for c in chunks],
            [c.num_new for c in chunks], block_size=e.cache_config.tokens_per_block,
            page_size=e.backend.page_size, page_index_multiplier=e.backend.page_index_multiplier,
            pad_to=md.batch_size if md.num_padded else None)
        assert_same_metadata(md, want, f"step {e.num_steps}: ")
        assert e.batch.slots == [r.slot for r in e.scheduler.running]
        self.kinds["decode" if md.is_decode else "mixed"] += 1
        self.kinds["padded"] += bool(md.num_padded)
        self._plan(md)


def run(engine: Engine, seed: int, max_prompt: int
        ) -> tuple[RebuildCheck, list[GenerationOutput]]:
    """Two waves of four requests (the second while the first decodes); the steps after
    each wave abort one request."""
    check = RebuildCheck(engine)
    rng = random.Random(seed)
    outs: list[GenerationOutput] = []

    def wave() -> list[int]:
        return [engine.add_request([rng.randrange(1, 60) for _ in range(rng.randrange(
            max_prompt // 2, max_prompt))], max_new_tokens=rng.randrange(4, 12))
            for _ in range(4)]

    for step in range(500):
        if step in (0, 6):
            rids = wave()
        if step in (4, 10):
            aborted = engine.abort(rids[step % 3])
            outs += [aborted] if aborted is not None else []
        outs += engine.step()
        if step > 6 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert engine.manager.leak_report() == []
    return check, outs


@pytest.mark.parametrize(("options", "pool", "max_prompt"), [
    pytest.param({"max_num_tokens": 7}, (4, 64), 24, id="chunked"),
    pytest.param({"max_num_tokens": 64, "page_size": 2}, (4, 64), 24, id="repaged"),
    pytest.param({"pad_decode": True, "graph_batch_sizes": (2, 4)}, (4, 64), 24, id="padded"),
    pytest.param({"max_num_tokens": 16}, (2, 9), 7, id="preempting"),
])
def test_every_step_equals_a_full_rebuild(options: dict[str, Any], pool: tuple[int, int],
                                          max_prompt: int) -> None:
    block, blocks = pool
    engine = Engine("tiny", KvCacheConfig(tokens_per_block=block, max_num_blocks=blocks),
                    max_batch_size=4, **options)
    check, outs = run(engine, seed=block, max_prompt=max_prompt)
    assert check.kinds["decode"] > 5 and check.kinds["mixed"] > 3, check.kinds
    assert any(o.finish_reason.value == "aborted" for o in outs)
    if "pad_decode" in options:
        assert check.kinds["padded"] > 0, check.kinds
    if blocks < 64:
        assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"


def test_a_failed_forward_leaves_the_batch_right_for_the_retry() -> None:
    """The batch counts a step's tokens when it hands out its metadata; a forward that
    then fails must not leave them counted (the scheduler runs the same step again)."""
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21]]
    cfg = KvCacheConfig(tokens_per_block=4, max_num_blocks=32)
    clean = Engine("tiny", cfg, max_num_tokens=6, max_batch_size=4).generate(prompts, 6)
    engine = Engine("tiny", cfg, max_num_tokens=6, max_batch_size=4)
    check = RebuildCheck(engine)
    forward = engine.model.forward
    calls = 0

    def fails_twice(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls in (3, 7):  # a chunked prefill step, then a decode step
            raise RuntimeError("injected forward failure")
        return forward(*args, **kwargs)

    engine.model.forward = fails_twice  # type: ignore[method-assign]
    rids = [engine.add_request(p, 6) for p in prompts]
    outs: dict[int, GenerationOutput] = {}
    failures = 0
    while engine.has_unfinished():
        try:
            outs.update((o.request_id, o) for o in engine.step())
        except RuntimeError:
            failures += 1
    assert failures == 2 and check.kinds["decode"] and check.kinds["mixed"]
    assert [outs[r].token_ids for r in rids] == [o.token_ids for o in clean]

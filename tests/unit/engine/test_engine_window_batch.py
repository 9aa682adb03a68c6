"""A windowed engine's persistent batch: every step's metadata equals build_metadata over
the block table, while running requests release blocks at their rows' fronts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvcache import Engine, KvCacheConfig
from kvcache.attention.metadata import PagedMetadata, build_metadata
from kvcache.model import get_preset
from tests.unit.attention.support import assert_same_metadata

PRESET = "tiny-swa"
WINDOW = get_preset(PRESET).sliding_window


class StepCheck:
    """Wraps the engine's batch.step: each step's metadata is compared, field by field,
    with a rebuild from the table over the running requests it covers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.step = engine.batch.step
        self.steps = self.decode_steps_with_starts = 0
        engine.batch.step = self  # type: ignore[method-assign]

    def __call__(self, num_new: list[int] | None = None, *,
                 pad_to: int | None = None) -> PagedMetadata:
        md = self.step(num_new, pad_to=pad_to)
        engine = self.engine
        running = engine.scheduler.running
        counts = num_new if num_new is not None else [1] * len(running)
        taking = [(req, n) for req, n in zip(running, counts, strict=True) if n]
        backend = engine.backend
        want = build_metadata(engine.table, np.array([req.slot for req, _ in taking]),
                              [req.num_computed for req, _ in taking], [n for _, n in taking],
                              block_size=engine.cache_config.tokens_per_block,
                              page_size=backend.page_size,
                              page_index_multiplier=backend.page_index_multiplier,
                              pad_to=pad_to)
        assert_same_metadata(md, want, f"step {self.steps}: ")
        self.steps += 1
        self.decode_steps_with_starts += md.is_decode and md.kv_start is not None
        return md


@pytest.mark.parametrize(("B", "page_size", "blocks"), [
    pytest.param(4, None, 96, id="B4"),
    pytest.param(16, None, 24, id="B16"),
    pytest.param(16, 4, 24, id="B16-p4"),
    pytest.param(4, None, 40, id="B4-tight"),  # short of blocks: requests wait and preempt
])
@pytest.mark.parametrize("pad", [pytest.param(False, id="eager"), pytest.param(True, id="pad")])
def test_every_step_equals_the_table_rebuild(B: int, page_size: int | None, blocks: int,
                                             pad: bool) -> None:
    """Prompts up to 3 windows long, chunked, then 40 decodes each: rows release blocks
    at their fronts during prefill and between decode steps, join and leave."""
    assert WINDOW is not None
    engine = Engine(PRESET, KvCacheConfig(tokens_per_block=B, max_num_blocks=blocks),
                    max_num_tokens=24, max_batch_size=4, page_size=page_size,
                    pad_decode=pad)
    check = StepCheck(engine)
    rng = random.Random(B)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (20, 50, 95, 70, 33, 64)]
    outs = engine.generate(prompts, max_new_tokens=40, return_logits=False)
    assert [len(o.token_ids) for o in outs] == [40] * len(prompts)
    assert check.decode_steps_with_starts > 10, "decode steps over released blocks"
    engine.manager.check_integrity()

"""The engine with CUDA graphs on against the same engine with them off, on FlashInfer.

Five requests with prompts that end mid-block prefill in one step, then decode for 11
steps while the batch shrinks 5 -> 4 -> 3 -> 2 (padded to the captured 8, 4, 4, 2) and
every sequence crosses block and page boundaries. The tiny preset's 4 query heads per 2
KV heads take FlashInfer's CUDA-core decode kernel; a variant with 8 query heads takes
the tensor-core one (head_dim 128, the kernels test_flashinfer_gpu.py compiled already).
The graph run is teacher-forced with the eager run's tokens, so both
see the same sequences; its logits must match, and its own greedy choice must agree
wherever the eager run's choice was not a near-tie.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable

import pytest
import torch

from kvcache import Engine, GenerationOutput, KvCacheConfig
from kvcache.attention.flashinfer.backend import FlashInferBackend
from kvcache.attention.flashinfer.calls import KernelFamily
from kvcache.attention.layer_windows import LayerWindows
from kvcache.model import Transformer, get_preset
from tests.gpu.support import FAMILIES, Measure, family_or_skip

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer, pytest.mark.cuda_graph]

ATOL = 1e-2  # fp16 at the tiny model's logit scale (|logit| < 1), as the scenarios use
SIZES = (1, 2, 4, 8)
PROMPTS = [37, 21, 50, 9, 64]
NEW = [12, 9, 12, 4, 10]
# The two decode kernels: the tiny preset (4 query heads, 2 KV heads) and a variant.
TENSOR_CORES = dataclasses.replace(get_preset("tiny"), num_heads=8, head_dim=128)
MODELS = {"cuda-cores": get_preset("tiny"), "tensor-cores": TENSOR_CORES}
HEADS = [pytest.param(name, id=name) for name in MODELS]
# Windowed layers interleaved with full ones: two FlashInfer backends planned per step.
MODELS["mixed-windows"] = get_preset("tiny-mixed-swa")


def make_engine(kernel: str, family: KernelFamily, *, cuda_graph: bool,
                page_size: int | None = None, max_num_tokens: int = 512) -> Engine:
    return Engine(Transformer(MODELS[kernel], seed=0),
                  KvCacheConfig(tokens_per_block=16, max_num_blocks=96),
                  attn_backend="flashinfer", device="cuda", dtype=torch.float16,
                  cuda_graph=cuda_graph, graph_batch_sizes=SIZES, page_size=page_size,
                  max_num_tokens=max_num_tokens, backend_options={"kernel_family": family})


def run(engine: Engine, force: list[list[int]] | None = None
        ) -> tuple[list[GenerationOutput], dict[int, list[Hashable]]]:
    """Outputs in request order, and each graph size's plan layouts in the order they
    changed (read after every step: a size planned under a new layout shows it)."""
    rng = random.Random(0)
    rids = [engine.add_request([rng.randrange(1, 500) for _ in range(n)], new,
                               force_tokens=force[i] if force else None)
            for i, (n, new) in enumerate(zip(PROMPTS, NEW, strict=True))]
    layouts: dict[int, list[Hashable]] = {}
    done: dict[int, GenerationOutput] = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
        if engine.graphs is None:
            continue
        backend = engine.backend
        assert isinstance(backend, FlashInferBackend | LayerWindows)
        for size in SIZES:
            try:
                layout = backend.graph_layout(size)
            except ValueError:
                continue  # not planned yet
            seen = layouts.setdefault(size, [])
            if not seen or seen[-1] != layout:
                seen.append(layout)
    return [done[r] for r in rids], layouts


def assert_graphs_match_eager(measure: Measure, eager: list[GenerationOutput],
                              graphed: list[GenerationOutput]) -> None:
    for e, g in zip(eager, graphed, strict=True):
        assert e.logits is not None and g.logits is not None
        measure.close(f"request {e.request_id} logits", g.logits, e.logits, ATOL)
        top2 = e.logits.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 2 * ATOL
        own = g.logits.argmax(-1)
        mismatched = [i for i in range(len(e.token_ids))
                      if decided[i] and int(own[i]) != e.token_ids[i]]
        assert not mismatched, (f"request {e.request_id}: the graph run's greedy tokens "
                                f"differ at {mismatched} where the eager choice was clear")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("page_size", [pytest.param(None, id="p16"), pytest.param(4, id="p4")])
@pytest.mark.parametrize("kernel", HEADS)
def test_graphs_on_equal_graphs_off(measure: Measure, kernel: str, page_size: int | None,
                                    family: KernelFamily) -> None:
    family = family_or_skip(family)
    eager, _ = run(make_engine(kernel, family, cuda_graph=False, page_size=page_size))
    engine = make_engine(kernel, family, cuda_graph=True, page_size=page_size)
    graphed, layouts = run(engine, force=[o.token_ids for o in eager])
    assert_graphs_match_eager(measure, eager, graphed)
    graphs = engine.graphs
    assert graphs is not None and isinstance(engine.backend, FlashInferBackend)
    assert graphs.replays == max(NEW) - 1 >= 8  # every decode step: the prefill sampled once
    assert {8, 4, 2} <= set(layouts), f"sizes planned: {sorted(layouts)}"
    # One capture per size, plus one per layout change the replays had to follow.
    assert graphs.captures == sum(len(seen) for seen in layouts.values())
    measure.kernels(engine.backend)
    measure.note("captures", graphs.captures)
    measure.note("layout_changes", graphs.captures - len(layouts))


@pytest.mark.parametrize("kernel", HEADS)
def test_one_token_chunks_on_the_graph_path(measure: Measure, kernel: str) -> None:
    """A 1-token budget makes every prefill step a decode-shaped batch of one that
    samples nothing until the prompt's last token: the graph path with no sampled row."""
    eager, _ = run(make_engine(kernel, "auto", cuda_graph=False, max_num_tokens=1))
    engine = make_engine(kernel, "auto", cuda_graph=True, max_num_tokens=1)
    graphed, _ = run(engine, force=[o.token_ids for o in eager])
    assert_graphs_match_eager(measure, eager, graphed)
    assert engine.graphs is not None and engine.graphs.replays == engine.num_steps


def test_mixed_windows_graphs_on_equal_graphs_off(measure: Measure) -> None:
    """A model interleaving 32-token-window layers with full ones: each window has its own
    FlashInfer backend, both planned every step, and a captured graph replays only while
    neither member's plan layout changed. Prompts and decodes run past the window."""
    eager, _ = run(make_engine("mixed-windows", "auto", cuda_graph=False))
    engine = make_engine("mixed-windows", "auto", cuda_graph=True)
    backend = engine.backend
    assert isinstance(backend, LayerWindows)
    assert sorted(m.window_left for m in backend.members) == [-1, 31]
    graphed, layouts = run(engine, force=[o.token_ids for o in eager])
    assert_graphs_match_eager(measure, eager, graphed)
    graphs = engine.graphs
    assert graphs is not None and graphs.replays == max(NEW) - 1
    assert graphs.captures == sum(len(seen) for seen in layouts.values())
    for member in backend.members:
        assert isinstance(member, FlashInferBackend)
        measure.kernels(member)

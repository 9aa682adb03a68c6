"""CUDA-graph decode through the FlashInfer backend against the torch reference.

Both decode kernels are covered: 2 query heads per KV head take FlashInfer's CUDA-core
decode kernel, 4 its tensor-core one. A forward is captured once and replayed after
re-plans that change the page counts and the number of real requests (padded to the
captured size). Like kvcache.engine.cuda_graphs, a replay happens only under the plan
layout seen at capture; a changed layout is captured again, and the count recorded.
Only real rows are compared: padding rows are undefined, and the long-context case
below makes them garbage on purpose.
"""

from __future__ import annotations

import pytest
import torch

from kvcache.attention import PagedMetadata
from kvcache.attention.flashinfer.backend import FlashInferBackend
from kvcache.attention.flashinfer.calls import KernelFamily
from kvcache.attention.reference import ReferenceBackend
from kvcache.storage.kv_storage import KvLayout
from tests.gpu.support import (
    DECODE_PATHS,
    LAYOUTS,
    PAGES,
    TOL,
    Measure,
    backends,
    capture,
    family_or_skip,
    make_pair,
    random_qkv,
)

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer, pytest.mark.cuda_graph]

BATCH = 8
STEPS = [
    [(15, 1), (31, 1), (7, 1), (0, 1), (40, 1)],    # 5 real + 3 padding
    [(16, 1), (32, 1), (8, 1), (1, 1), (41, 1)],    # two requests cross a page
    [(47, 1), (3, 1), (64, 1)],                     # fewer requests, new lengths
    [(200, 1)],                                     # one request, many more pages
]
# (query heads, family): the family only changes the tensor-core kernel.
PATHS = [pytest.param(4, "auto", id="cuda-cores"),
         pytest.param(8, "auto", id="tensor-cores-auto"),
         pytest.param(8, "fa2", id="tensor-cores-fa2"),
         pytest.param(8, "fa3", id="tensor-cores-fa3")]


class GraphedForward:
    """One layer's forward captured over static q/k/v, replayed after each re-plan."""

    def __init__(self, fi: FlashInferBackend, ref: ReferenceBackend, layer: int,
                 dtype: torch.dtype) -> None:
        self.fi, self.ref, self.layer, self.dtype = fi, ref, layer, dtype
        H, Hkv, D = ref.num_qo_heads, ref.num_kv_heads, ref.head_dim
        self.q = torch.zeros(BATCH, H, D, dtype=dtype, device="cuda")
        self.k = torch.zeros(BATCH, Hkv, D, dtype=dtype, device="cuda")
        self.v = torch.zeros_like(self.k)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.layout: object = None  # the plan layout at capture
        self.out = torch.empty(0)
        self.captures = 0

    def step(self, md: PagedMetadata, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(FlashInfer's real rows after a replay, the reference's) for one step."""
        q, k, v = random_qkv(BATCH, self.ref.num_qo_heads, self.ref.num_kv_heads,
                             self.ref.head_dim, self.dtype, seed)
        self.ref.plan(md)
        want = self.ref.forward(self.layer, q, k, v)
        self.fi.plan(md)  # outside capture: refreshes the graph buffers
        for static, new in ((self.q, q), (self.k, k), (self.v, v)):
            static.copy_(new)
        layout = self.fi.graph_layout(BATCH)
        if self.graph is None or layout != self.layout:
            self.graph, self.out = capture(
                lambda: self.fi.forward(self.layer, self.q, self.k, self.v))
            self.layout, self.captures = layout, self.captures + 1
        self.graph.replay()
        torch.cuda.synchronize()
        return self.out[: md.num_requests], want[: md.num_requests]


@pytest.mark.parametrize(("num_qo_heads", "family"), PATHS)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_graph_decode_replays_after_page_counts_change(measure: Measure, layout: KvLayout,
                                                       page_size: int, num_qo_heads: int,
                                                       family: KernelFamily) -> None:
    family = family_or_skip(family)
    pair = make_pair([210] * 5, layout, torch.float16)
    fi, ref = backends(pair, page_size, num_qo_heads, family, graph_batch_sizes=(4, BATCH))
    graphed = GraphedForward(fi, ref, layer=1, dtype=torch.float16)
    for i, requests in enumerate(STEPS):
        got, want = graphed.step(pair.metadata(requests, page_size, pad_to=BATCH), seed=10 + i)
        measure.close(f"step {i} ({len(requests)} real)", got, want, TOL[torch.float16])
        pair.assert_same_storage()
    measure.kernels(fi)
    measure.note("captures", graphed.captures)


@pytest.mark.parametrize("num_qo_heads", DECODE_PATHS)
def test_long_context_padded_graph_decode(measure: Measure, num_qo_heads: int) -> None:
    """One real request whose pages fill the whole captured grid, padded to 8.

    FlashInfer's CUDA-core decode planner searches the KV chunk size counting zero-page
    (padding) requests as 0 chunks, then counts them as 1 in the work list: with
    pages = 9 * grid the search settles on 9-page chunks and exactly `grid` items for
    the real row, and the 7 padding items fall off the fixed grid. Their outputs are
    then garbage, not zeros; the real row must still be exact, and nothing may read
    the others.
    """
    dtype, page = torch.float16, 16
    probe = make_pair([64, 64], "NHD", dtype, num_layers=1)
    fi, _ = backends(probe, page, num_qo_heads, graph_batch_sizes=(BATCH,))
    fi.plan(probe.metadata([(40, 1), (63, 1)], page, pad_to=BATCH))
    grid = fi.graph_layout(BATCH).plan_info[0]  # padded_batch_size: the launch's work items
    kv_len = 9 * grid * page  # the last page full: exactly 9 * grid pages
    pair = make_pair([kv_len], "NHD", dtype, num_layers=1, seed=7)
    fi, ref = backends(pair, page, num_qo_heads, graph_batch_sizes=(BATCH,))
    graphed = GraphedForward(fi, ref, layer=0, dtype=dtype)
    got, want = graphed.step(pair.metadata([(kv_len - 1, 1)], page, pad_to=BATCH), seed=8)
    measure.close(f"real row over {kv_len} tokens", got, want, TOL[dtype])
    measure.note("grid", grid)
    measure.note("padding_rows_finite", bool(graphed.out[1:].isfinite().all()))
    measure.kernels(fi)
    pair.assert_same_storage()

"""CUDA-graph capture and replay of decode steps, one graph per padded batch size.

Decode batches are padded to a captured size with zero-page requests, so one graph
serves any batch up to that size and any page count: the backend's graph-mode plan (run
outside capture, every step) rewrites the preallocated metadata buffers the captured
kernels read. Each size is warmed up eagerly before its capture.

What a plan cannot rewrite is the launch itself (grid, split-KV choice, workspace
offsets): the backend reports it per size as a plan layout, kept at capture. A later
plan whose layout differs would replay kernels scheduled for another work list, so the
graph of that size is captured again (and the change logged) before it is replayed.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from kvcache.attention.base import AttentionBackend
from kvcache.attention.metadata import PagedMetadata
from kvcache.model.transformer import ForwardContext, Transformer

log = logging.getLogger(__name__)


@runtime_checkable
class GraphLayouts(Protocol):
    """A backend that reports, per CUDA-graph batch size, what a capture depends on."""

    def graph_layout(self, batch_size: int) -> Hashable:
        """The layout of that size's latest plan; equal layouts replay alike."""


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor
    layout: Hashable


def replay_blocker(captured: Hashable, now: Hashable) -> str | None:
    """None when a graph captured under layout `captured` may replay under `now`; else
    why not (the layout's own `changes(since)` when it has one, both reprs otherwise)."""
    if captured == now:
        return None
    changes = getattr(now, "changes", None)
    detail = changes(captured) if callable(changes) else None
    return ", ".join(detail) if detail else f"layout {captured!r} -> {now!r}"


class DecodeGraphs:
    """Captured decode forwards keyed by batch size (CUDA only).

    Raises ValueError for a non-CUDA device or a backend without graph layouts.
    `replays` and `captures` count what run() did (a size captured again after a
    layout change counts twice).
    """

    def __init__(self, model: Transformer, backend: AttentionBackend, sizes: Sequence[int],
                 device: torch.device) -> None:
        if not isinstance(backend, GraphLayouts):
            raise ValueError(f"DecodeGraphs: backend {backend.name!r} does not report graph "
                             f"plan layouts, so its replays could not be checked")
        if device.type != "cuda":
            raise ValueError(f"DecodeGraphs: CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.backend = backend
        self._layouts: GraphLayouts = backend
        self.sizes = frozenset(sizes)
        largest = max(sizes)
        self._ids = torch.zeros(largest, dtype=torch.long, device=device)
        self._positions = torch.zeros(largest, dtype=torch.long, device=device)
        self._graphs: dict[int, _Captured] = {}
        self.replays = 0
        self.captures = 0

    def run(self, md: PagedMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
        """Logits [batch, vocab] of a padded decode batch (padding rows undefined),
        capturing its size on first use or when its plan layout changed since capture."""
        batch_size = md.batch_size
        self.backend.plan(md)  # never inside capture
        layout = self._layouts.graph_layout(batch_size)
        self._ids[:batch_size].copy_(input_ids)
        self._positions[:batch_size].copy_(positions)
        entry = self._graphs.get(batch_size)
        blocker = None if entry is None else replay_blocker(entry.layout, layout)
        if blocker is not None:
            log.warning("decode graph of batch size %d: capturing again, its plan layout "
                        "changed since capture (%s)", batch_size, blocker)
            del self._graphs[batch_size]  # frees its memory pool before the new capture
            entry = None
        if entry is None:
            entry = self._graphs[batch_size] = self._capture(batch_size, ctx, layout)
        entry.graph.replay()
        self.replays += 1
        return entry.out

    def _capture(self, batch_size: int, ctx: ForwardContext, layout: Hashable) -> _Captured:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: appends rewrite the same slots
            for _ in range(2):
                self.model(self._ids[:batch_size], self._positions[:batch_size], ctx)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.model(self._ids[:batch_size], self._positions[:batch_size], ctx)
        self.captures += 1
        return _Captured(graph, out, layout)

"""CUDA-graph capture and replay of decode steps, one graph per padded batch size.

Decode batches are padded to a captured size with zero-page requests, so one graph
serves any batch up to that size and any page count: the backend's graph-mode plan (run
outside capture, every step) rewrites the preallocated metadata buffers the captured
kernels read. Each size is warmed up eagerly before its capture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.attention.base import AttentionBackend
from kvcache.attention.metadata import PagedMetadata
from kvcache.model.transformer import ForwardContext, Transformer


class DecodeGraphs:
    """Captured decode forwards keyed by batch size (CUDA only)."""

    def __init__(self, model: Transformer, backend: AttentionBackend, sizes: Sequence[int],
                 device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"DecodeGraphs: CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.backend = backend
        self.sizes = frozenset(sizes)
        largest = max(sizes)
        self._ids = torch.zeros(largest, dtype=torch.long, device=device)
        self._pos = torch.zeros(largest, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def run(self, md: PagedMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
        """Logits [batch, vocab] of a padded decode batch, capturing its size on first use."""
        bs = md.batch_size
        self.backend.plan(md)  # never inside capture
        self._ids[:bs].copy_(input_ids)
        self._pos[:bs].copy_(positions)
        entry = self._graphs.get(bs)
        if entry is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: appends rewrite the same slots
                for _ in range(2):
                    self.model(self._ids[:bs], self._pos[:bs], ctx)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.model(self._ids[:bs], self._pos[:bs], ctx)
            entry = self._graphs[bs] = (graph, out)
        entry[0].replay()
        return entry[1]

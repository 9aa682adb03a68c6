"""CUDA-graph replay safety on CPU: when a captured decode graph may replay, and what
DecodeGraphs refuses up front (capture and replay themselves run in tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from kvcache.attention.flashinfer.plan_layout import CUDA_CORES, PlanLayout
from kvcache.attention.reference import ReferenceBackend
from kvcache.engine.cuda_graphs import DecodeGraphs, GraphLayouts, replay_blocker
from kvcache.model import Transformer, get_preset
from kvcache.storage.kv_storage import KvStorage

DECODE_INFO = (132, 0, 270336, 0, 528, 1056, 1600, 1584, 1, 1)


def test_a_graph_replays_only_under_the_layout_of_its_capture() -> None:
    captured = PlanLayout(CUDA_CORES, DECODE_INFO)
    assert replay_blocker(captured, PlanLayout(CUDA_CORES, DECODE_INFO)) is None
    unsplit = PlanLayout(CUDA_CORES, (8, *DECODE_INFO[1:9], 0))
    assert replay_blocker(captured, unsplit) == "padded_batch_size 132 -> 8, split_kv 1 -> 0"
    assert replay_blocker(captured, PlanLayout("fa2", tuple(range(15)))) == \
        "kernels cuda-cores -> fa2"
    # Any hashable layout works; without changes() both are shown.
    assert replay_blocker(("a", 1), ("a", 1)) is None
    assert replay_blocker(("a", 1), ("a", 2)) == "layout ('a', 1) -> ('a', 2)"


def _reference() -> tuple[Transformer, ReferenceBackend]:
    mc = get_preset("tiny")
    storage = KvStorage(num_layers=mc.num_layers, num_blocks=4, block_size=4,
                        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)
    return Transformer(mc), ReferenceBackend(storage=storage, num_qo_heads=mc.num_heads,
                                             num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)


def test_decode_graphs_need_a_backend_with_layouts_and_a_cuda_device() -> None:
    model, backend = _reference()
    assert not isinstance(backend, GraphLayouts)
    with pytest.raises(ValueError, match="backend 'torch' does not report graph plan layouts"):
        DecodeGraphs(model, backend, (1, 2), torch.device("cuda"))

    class WithLayouts(ReferenceBackend):
        def graph_layout(self, batch_size: int) -> PlanLayout:
            return PlanLayout(CUDA_CORES, DECODE_INFO)

    storage = backend.storage
    laid_out = WithLayouts(storage=storage, num_qo_heads=4, num_kv_heads=storage.num_kv_heads,
                           head_dim=storage.head_dim)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got cpu"):
        DecodeGraphs(model, laid_out, (1, 2), torch.device("cpu"))

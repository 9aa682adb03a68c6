"""LayerWindows: attention layers with different windows, one member backend per window.

Models such as Gemma 2/3 and GPT-OSS interleave sliding-window layers with full-attention
ones. FlashInfer fixes `window_left` when a wrapper is planned (`run` may not override
it), so one plan cannot serve both kinds of layer; vLLM likewise gives each window its
own attention metadata group. Here every distinct window gets its own backend over the
shared storage, each is planned with the step's metadata, and a layer appends and
attends through the member of its window. The block tables are shared: the cache keeps
every block the widest window needs (all of them when some layer attends in full).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import torch

from kvcache.attention.base import AttentionBackend, AttentionOutput
from kvcache.attention.metadata import PagedMetadata


def backend_for_windows(backend_cls: type[AttentionBackend], window_lefts: Sequence[int],
                        **options: Any) -> AttentionBackend:
    """A `backend_cls` over storage layers attending with `window_lefts` (one per layer,
    FlashInfer's convention): a plain backend when they are all equal, else a
    LayerWindows with one member per distinct window. `options` go to every member.
    Raises what the backend's constructor raises."""
    distinct = sorted(set(window_lefts))
    if len(distinct) == 1:
        return backend_cls(window_left=distinct[0], **options)
    members = {w: backend_cls(window_left=w, **options) for w in distinct}
    return LayerWindows([members[w] for w in window_lefts])


class LayerWindows(AttentionBackend):
    """Routes each storage layer to the backend planned with that layer's window.

    `per_layer[i]` serves storage layer i; layers with the same window share one member
    (pass the same instance). Members must be of one class and agree on storage, heads,
    page size, scale and soft cap. The composite's own `window_left` is the widest
    member's (-1 when any attends in full), which is what a request with released
    blocks is checked against.

    Raises ValueError naming the disagreement otherwise.
    """

    name: ClassVar[str] = "layer-windows"
    supports_block_reuse: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True

    def __init__(self, per_layer: Sequence[AttentionBackend]) -> None:
        if not per_layer:
            raise ValueError("LayerWindows: per_layer is empty; give one backend per layer")
        first = per_layer[0]
        members: list[AttentionBackend] = []
        for layer, member in enumerate(per_layer):
            _check_same(first, member, layer)
            if all(member is not m for m in members):
                members.append(member)
        windows = [m.window_left for m in members]
        if len(set(windows)) != len(windows):
            raise ValueError(f"LayerWindows: two members share window_left "
                             f"{sorted(windows)}; layers with one window share one member")
        if len(per_layer) != first.storage.num_layers:
            raise ValueError(f"LayerWindows: {len(per_layer)} layers given, the storage has "
                             f"{first.storage.num_layers}")
        widest = -1 if -1 in windows else max(windows)
        super().__init__(storage=first.storage, num_qo_heads=first.num_qo_heads,
                         num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
                         page_size=first.page_size, sm_scale=first.sm_scale,
                         window_left=widest, logits_soft_cap=first.logits_soft_cap)
        self.members: tuple[AttentionBackend, ...] = tuple(members)
        self._per_layer = tuple(per_layer)

    def member(self, layer: int) -> AttentionBackend:
        """The backend storage layer `layer` attends through."""
        return self._per_layer[layer]

    def _plan(self, md: PagedMetadata) -> None:
        for member in self.members:
            member.plan(md)

    def _append(self, layer: int, md: PagedMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        self._per_layer[layer]._append(layer, md, k, v)

    def _attend(self, layer: int, md: PagedMetadata, q: torch.Tensor,
                return_lse: bool) -> AttentionOutput:
        return self._per_layer[layer]._attend(layer, md, q, return_lse)

    def graph_layout(self, batch_size: int) -> Hashable:
        """Every member's CUDA-graph plan layout of `batch_size`, in member order: a
        captured decode graph replays only while none of them changed. Raises
        ValueError when the members do not report graph layouts."""
        layouts = []
        for member in self.members:
            report = getattr(member, "graph_layout", None)
            if report is None:
                raise ValueError(f"LayerWindows.graph_layout: backend {member.name!r} has no "
                                 "CUDA-graph plan layouts")
            layouts.append(report(batch_size))
        return tuple(layouts)


def _check_same(first: AttentionBackend, other: AttentionBackend, layer: int) -> None:
    for attr in ("storage", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                 "sm_scale", "logits_soft_cap"):
        a, b = getattr(first, attr), getattr(other, attr)
        if a is not b and a != b:
            raise ValueError(f"LayerWindows: layer {layer}'s backend has {attr}={b!r}, layer "
                             f"0's has {a!r}; members must agree on all but the window")
    if type(other) is not type(first):
        raise ValueError(f"LayerWindows: layer {layer}'s backend is {type(other).__name__}, "
                         f"layer 0's {type(first).__name__}; members must be of one class")

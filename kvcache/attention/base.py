"""The attention backend interface: plan once per step, then append-and-attend per layer."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple, Required, TypedDict

import torch

from kvcache.attention.metadata import PagedMetadata
from kvcache.storage.kv_storage import KvStorage, PageViews


class AttentionOutput(NamedTuple):
    """o: [T, Hq, D] in q's dtype; lse: [T, Hq] float32, log base 2 (None if not asked)."""

    o: torch.Tensor
    lse: torch.Tensor | None


class BackendOptions(TypedDict, total=False):
    """AttentionBackend's constructor arguments, for subclasses that add their own."""

    storage: Required[KvStorage]
    num_qo_heads: Required[int]
    num_kv_heads: Required[int]
    head_dim: Required[int]
    page_size: int | None
    sm_scale: float | None
    window_left: int
    logits_soft_cap: float | None


class AttentionBackend(ABC):
    """Paged attention over a KvStorage, following FlashInfer's definitions.

    Per step: `plan(md)` once, then `forward(layer, q, k, v)` per layer, which writes the
    new tokens' k and v into the storage at the planned slots (mutating it) and then
    attends. Query i of a request (qo_len new tokens, kv_len keys in all) sees key j iff
    j <= i + kv_len - qo_len, and with window_left w >= 0 also j >= i + kv_len - qo_len - w.
    Query head h reads kv head h // (Hq / Hkv). With logits_soft_cap c the scaled logit s
    becomes c * tanh(s / c). window_left = -1 means no window (FlashInfer's convention).
    Padding requests (zero pages, a padded CUDA-graph batch) append nothing, and their
    output and lse rows are undefined: nothing may read them. (FlashInfer's CUDA-core
    decode planner can drop padding rows' work items under CUDA graphs, leaving garbage
    there; the torch reference happens to return zeros, lse -inf.)

    A request whose leading blocks were released (sliding window; `md.kv_start`) lists
    its keys from position kv_start: kv_len, the pages and the masks count from there.
    Backends whose masks are relative to the listed keys declare
    `supports_sliding_window`; `plan` refuses released blocks on the others, and on any
    request whose first query's window would reach before its first listed key.
    """

    name: ClassVar[str]
    supports_block_reuse: ClassVar[bool]
    supports_sliding_window: ClassVar[bool]

    def __init__(
        self,
        *,
        storage: KvStorage,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int | None = None,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
    ) -> None:
        where = type(self).__name__
        if num_kv_heads != storage.num_kv_heads or head_dim != storage.head_dim:
            raise ValueError(f"{where}: num_kv_heads={num_kv_heads}, head_dim={head_dim} do not "
                             f"match the storage ({storage.num_kv_heads}, {storage.head_dim})")
        if num_qo_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"{where}: num_qo_heads={num_qo_heads} must be a positive multiple "
                             f"of num_kv_heads={num_kv_heads}")
        if window_left < -1:
            raise ValueError(f"{where}: window_left={window_left} must be -1 (none) or >= 0")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"{where}: logits_soft_cap={logits_soft_cap} must be > 0 or None")
        if sm_scale is not None and not sm_scale > 0:
            raise ValueError(f"{where}: sm_scale={sm_scale} must be > 0 or None")
        self.storage = storage
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = storage.block_size if page_size is None else page_size
        # Raises ValueError when page_size does not divide the block size.
        self.page_index_multiplier = storage.page_index_multiplier(self.page_size)
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        self.window_left = window_left
        self.logits_soft_cap = logits_soft_cap
        self._md: PagedMetadata | None = None

    @property
    def pages(self) -> PageViews:
        """Every layer's (k, v) page views at this backend's page size. Read from the
        storage on each use and never kept here, so releasing the storage frees its
        memory while the backend lives; RuntimeError after that release."""
        return self.storage.page_views(self.page_size)

    def plan(self, md: PagedMetadata) -> None:
        """Prepare this step's metadata for every layer's forward. Raises ValueError if
        md was built for another page size."""
        if md.page_size != self.page_size:
            raise ValueError(f"{type(self).__name__}.plan: metadata page_size={md.page_size} "
                             f"but the backend reads pages of {self.page_size}")
        if md.kv_start is not None:
            self._check_released(md)
        self._md = md
        self._plan(md)

    def _check_released(self, md: PagedMetadata) -> None:
        """Raise ValueError if a request listing its keys from kv_start > 0 has a query
        whose window reaches before that key (or attends without a window)."""
        assert md.kv_start is not None
        num_requests = md.num_requests
        start = md.kv_start[:num_requests]
        if not bool((start > 0).any()):
            return
        where = f"{type(self).__name__}.plan"
        b = int(torch.nonzero(start > 0)[0])
        if not self.supports_sliding_window or self.window_left < 0:
            why = ("the backend does not support released blocks" if self.window_left >= 0
                   else "it attends without a window (window_left=-1)")
            raise ValueError(f"{where}: request {b} lists its keys from position "
                             f"{int(start[b])} (earlier blocks released), but {why}")
        qo_len = md.qo_indptr[1:num_requests + 1] - md.qo_indptr[:num_requests]
        reach = md.kv_lens[:num_requests] - qo_len - self.window_left  # first query's first key
        bad = (start > 0) & (reach < 0)
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise ValueError(f"{where}: request {b}'s first new token sees keys from "
                             f"{-int(reach[b])} positions before its first listed key "
                             f"(position {int(start[b])}): blocks it needs were released")

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Append k, v [T, Hkv, D] for `layer`, then attend: returns o [T, Hq, D]."""
        return self.forward_with_lse(layer, q, k, v, return_lse=False).o

    def forward_with_lse(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         return_lse: bool = True) -> AttentionOutput:
        """As forward, and the base-2 log-sum-exp of each query row's logits if asked.

        Raises RuntimeError before plan() and ValueError on shape or dtype mismatches.
        """
        md = self._check_inputs(layer, q, k, v)
        self._append(layer, md, k, v)
        return self._attend(layer, md, q, return_lse)

    def _check_inputs(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> PagedMetadata:
        md = self._md
        if md is None:
            raise RuntimeError(f"{type(self).__name__}.forward called before plan()")
        if not 0 <= layer < self.storage.num_layers:
            raise ValueError(f"forward: layer={layer} is outside [0, {self.storage.num_layers})")
        T = md.num_tokens
        for name, t, heads in (("q", q, self.num_qo_heads), ("k", k, self.num_kv_heads),
                               ("v", v, self.num_kv_heads)):
            if tuple(t.shape) != (T, heads, self.head_dim):
                raise ValueError(f"forward: {name} has shape {tuple(t.shape)}, expected "
                                 f"{(T, heads, self.head_dim)} from the planned metadata")
        if k.dtype != self.storage.dtype or v.dtype != self.storage.dtype:
            raise ValueError(f"forward: k/v dtype {k.dtype}/{v.dtype} differs from the storage "
                             f"dtype {self.storage.dtype}")
        return md

    @abstractmethod
    def _plan(self, md: PagedMetadata) -> None:
        """Backend-specific per-step preparation."""

    @abstractmethod
    def _append(self, layer: int, md: PagedMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the first md.num_append_tokens rows of k, v into the layer's pages."""

    @abstractmethod
    def _attend(self, layer: int, md: PagedMetadata, q: torch.Tensor,
                return_lse: bool) -> AttentionOutput:
        """Attend q over the layer's pages (the new tokens already appended)."""

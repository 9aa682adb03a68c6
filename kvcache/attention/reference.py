"""Pure-torch paged attention: the CPU oracle for the FlashInfer backend.

Reads exactly the metadata FlashInfer reads (CSR kv_indptr / kv_indices /
kv_last_page_len at kernel-page granularity) through the storage's page views, so a bug
in the metadata or the page views shows up here as well: each request's kv_len is
derived from its page count and last page's length, as FlashInfer derives it, and
`plan` refuses metadata whose `kv_lens` or page list says otherwise. Computes in float32.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from kvcache.attention.base import AttentionBackend, AttentionOutput
from kvcache.attention.metadata import PagedMetadata

_LN2 = math.log(2.0)


def paged_kv_lens(md: PagedMetadata, where: str) -> torch.Tensor:
    """Each request's kv_len as FlashInfer reads it from the page list: (pages - 1) *
    page_size + kv_last_page_len, 0 for a request with no pages (padding). Pure.

    Raises ValueError naming the request when a last page's length is outside [1,
    page_size] (0 without pages), when the result disagrees with `kv_lens`, or when
    kv_indptr lists more pages than kv_indices holds: a metadata bug, caught at plan.
    """
    P = md.page_size
    indptr, last = md.kv_indptr.long(), md.kv_last_page_len.long()
    pages = indptr[1:] - indptr[:-1]
    kv_len = torch.where(pages > 0, (pages - 1) * P + last, 0)
    bad = torch.where(pages > 0, (last < 1) | (last > P), last != 0) | (kv_len != md.kv_lens)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        raise ValueError(f"{where}.plan: request {b} lists {int(pages[b])} pages of {P} "
                         f"tokens with kv_last_page_len={int(last[b])}, which makes kv_len "
                         f"{int(kv_len[b])}, but kv_lens says {int(md.kv_lens[b])} (a last "
                         f"page holds 1 to {P} tokens; none without pages)")
    if int(indptr[-1]) > md.kv_indices.numel():
        raise ValueError(f"{where}.plan: kv_indptr lists {int(indptr[-1])} pages, but "
                         f"kv_indices holds {md.kv_indices.numel()}")
    return kv_len


class ReferenceBackend(AttentionBackend):
    """Torch reference backend ("torch"): a Python loop over requests, none over tokens."""

    name: ClassVar[str] = "torch"
    supports_block_reuse: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True

    def _plan(self, md: PagedMetadata) -> None:
        # Host lists once per step: per-request slicing reads them for every layer.
        self._qo_indptr = md.qo_indptr.tolist()
        self._kv_indptr = md.kv_indptr.tolist()
        self._kv_lens = paged_kv_lens(md, type(self).__name__).tolist()
        self._append_index = (md.append_pages.to(self.storage.device),
                              md.append_slots.to(self.storage.device))
        self._kv_indices = md.kv_indices.to(device=self.storage.device, dtype=torch.int64)

    def _append(self, layer: int, md: PagedMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        pages, slots = self._append_index
        n = md.num_append_tokens
        for view, new in zip(self.pages[layer], (k, v), strict=True):
            if self.storage.page_layout == "NHD":  # view [pages, P, H, D]
                view[pages, slots] = new[:n]
            else:                                   # view [pages, H, P, D]
                view[pages, :, slots] = new[:n]

    def gather_kv(self, layer: int, request: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's keys and values in position order, each [kv_len, Hkv, D]."""
        pages = self._kv_indices[self._kv_indptr[request]: self._kv_indptr[request + 1]]
        kv_len = self._kv_lens[request]
        out = []
        for view in self.pages[layer]:
            chunk = view[pages]
            if self.storage.page_layout == "HND":
                chunk = chunk.transpose(1, 2)  # [n, H, P, D] -> [n, P, H, D]
            out.append(chunk.reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len])
        return out[0], out[1]

    def request_mask(self, q_pos: torch.Tensor, kv_len: int, qo_len: int) -> torch.Tensor:
        """Bool [qo_len, kv_len]: which keys each query sees (bottom-right causal, window)."""
        j = torch.arange(kv_len, device=q_pos.device)
        mask = j[None, :] <= q_pos[:, None]
        if self.window_left >= 0:
            mask &= j[None, :] >= q_pos[:, None] - self.window_left
        return mask

    def _attend(self, layer: int, md: PagedMetadata, q: torch.Tensor,
                return_lse: bool) -> AttentionOutput:
        T, Hq, D = q.shape
        Hkv = self.num_kv_heads
        group = Hq // Hkv
        o = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
        lse = torch.full((T, Hq), -math.inf, dtype=torch.float32, device=q.device)
        for b in range(md.batch_size):
            q0, q1 = self._qo_indptr[b], self._qo_indptr[b + 1]
            kv_len = self._kv_lens[b]
            if kv_len == 0:  # padding: attends to nothing, output stays zero
                continue
            keys, values = self.gather_kv(layer, b)
            qo_len = q1 - q0
            q_pos = torch.arange(kv_len - qo_len, kv_len, device=q.device)
            # qb: [qo, Hkv, G, D]; keys: [kv, Hkv, D] -> scores [Hkv, G, qo, kv]
            qb = q[q0:q1].float().view(qo_len, Hkv, group, D)
            scores = torch.einsum("qhgd,khd->hgqk", qb, keys.float()) * self.sm_scale
            if self.logits_soft_cap is not None:
                cap = self.logits_soft_cap
                scores = cap * torch.tanh(scores / cap)
            visible = self.request_mask(q_pos, kv_len, qo_len)
            scores = scores.masked_fill(~visible, -math.inf)
            row_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G, qo]
            probs = torch.exp(scores - row_lse[..., None]).nan_to_num_(0.0)
            ob = torch.einsum("hgqk,khd->qhgd", probs, values.float())
            o[q0:q1] = ob.reshape(qo_len, Hq, D)
            lse[q0:q1] = (row_lse / _LN2).permute(2, 0, 1).reshape(qo_len, Hq)
        return AttentionOutput(o.to(q.dtype), lse if return_lse else None)

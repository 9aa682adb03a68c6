"""FlashInfer paged attention (GPU), with CUDA-graph buffers for padded decode batches.

flashinfer is imported when the backend is constructed, never at module import. Every
call into flashinfer goes through a small pure function below that returns its
arguments (`Call`), so CPU tests can bind them to the installed package's signatures.
Calls pass only keywords that FlashInfer 0.6.x and 0.7.x both accept.

CUDA-graph decode: for each size in graph_batch_sizes a decode wrapper is created with
use_cuda_graph=True over views of shared device buffers (one step uses one size, so
the sizes can share them). plan() runs outside capture and refreshes the buffers; the
captured forward reads them. Padding rows must append nowhere, but a graph needs a
fixed-shape append, so each padding row repeats the write of the first real token
(same source row, same destination): a duplicate of an identical write.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, NamedTuple, Unpack

import torch

from kvcache.attention.base import AttentionBackend, AttentionOutput, BackendOptions
from kvcache.attention.metadata import PagedMetadata
from kvcache.storage.kv_storage import KvLayout

WORKSPACE_BYTES = 128 * 1024 * 1024
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class Call(NamedTuple):
    """Positional and keyword arguments of one flashinfer call."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class KernelParams:
    """What every plan needs besides the metadata."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    window_left: int
    logits_soft_cap: float | None
    dtype: torch.dtype

    @property
    def decode_uses_tensor_cores(self) -> bool:
        """The CUDA-core decode kernel serves only small GQA groups well; larger ones
        go to the tensor-core (prefill) kernel."""
        return self.num_qo_heads // self.num_kv_heads > 2


class StepBuffers(NamedTuple):
    """Device metadata one step's append and attention read (for a CUDA-graph size:
    views of the shared persistent buffers, so captured kernels see every re-plan)."""

    kv_indptr: torch.Tensor      # int32 [B + 1]
    kv_indices: torch.Tensor     # int32 [capacity]
    kv_last_page_len: torch.Tensor  # int32 [B]
    append_batch: torch.Tensor   # int32 [rows]: request of each appended row
    append_pos: torch.Tensor     # int32 [rows]: its position in that request

    @classmethod
    def allocate(cls, max_batch: int, capacity: int, device: torch.device) -> StepBuffers:
        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)
        return cls(i32(max_batch + 1), i32(capacity), i32(max_batch), i32(max_batch),
                   i32(max_batch))

    def for_size(self, batch: int) -> StepBuffers:
        return StepBuffers(self.kv_indptr[: batch + 1], self.kv_indices,
                           self.kv_last_page_len[:batch], self.append_batch[:batch],
                           self.append_pos[:batch])


def prefill_wrapper_call(workspace: torch.Tensor, layout: KvLayout) -> Call:
    """BatchPrefillWithPagedKVCacheWrapper(...) over the shared float workspace."""
    return Call((workspace,), {"kv_layout": layout})


def decode_wrapper_call(workspace: torch.Tensor, layout: KvLayout, use_tensor_cores: bool,
                        graph: StepBuffers | None = None) -> Call:
    """BatchDecodeWithPagedKVCacheWrapper(...); with `graph`, a CUDA-graph wrapper whose
    plan() copies the metadata into those (persistent, device) buffers."""
    kwargs: dict[str, Any] = {"kv_layout": layout, "use_tensor_cores": use_tensor_cores}
    if graph is not None:
        kwargs.update(use_cuda_graph=True, paged_kv_indptr_buffer=graph.kv_indptr,
                      paged_kv_indices_buffer=graph.kv_indices,
                      paged_kv_last_page_len_buffer=graph.kv_last_page_len)
    return Call((workspace,), kwargs)


def _plan_options(p: KernelParams) -> dict[str, Any]:
    return {"pos_encoding_mode": "NONE", "window_left": p.window_left,
            "logits_soft_cap": p.logits_soft_cap, "sm_scale": p.sm_scale,
            "q_data_type": p.dtype, "kv_data_type": p.dtype}


def prefill_plan_call(p: KernelParams, md: PagedMetadata, kv_indices: torch.Tensor) -> Call:
    """prefill.plan(...): causal, host qo_indptr / kv_indptr / last_page_len (FlashInfer
    schedules on the host), kv_indices on the device (or host: plan copies it)."""
    return Call((md.qo_indptr, md.kv_indptr, kv_indices, md.kv_last_page_len, p.num_qo_heads,
                 p.num_kv_heads, p.head_dim, p.page_size), {"causal": True, **_plan_options(p)})


def decode_plan_call(p: KernelParams, md: PagedMetadata, kv_indices: torch.Tensor) -> Call:
    """decode.plan(...): host indptr / last_page_len, kv_indices on the device or host."""
    return Call((md.kv_indptr, kv_indices, md.kv_last_page_len, p.num_qo_heads,
                 p.num_kv_heads, p.head_dim, p.page_size), _plan_options(p))


def run_call(q: torch.Tensor, kv_pages: tuple[torch.Tensor, torch.Tensor],
             return_lse: bool) -> Call:
    """wrapper.run(q, (k_pages, v_pages)); with return_lse it returns (o, lse base 2)."""
    return Call((q, kv_pages), {"return_lse": return_lse})


def append_call(k: torch.Tensor, v: torch.Tensor, buffers: StepBuffers,
                kv_pages: tuple[torch.Tensor, torch.Tensor], layout: KvLayout) -> Call:
    """flashinfer.page.append_paged_kv_cache(...): row i of k/v goes to request
    append_batch[i] at position append_pos[i], through the step's device CSR."""
    return Call((k, v, buffers.append_batch, buffers.append_pos, kv_pages, buffers.kv_indices,
                 buffers.kv_indptr, buffers.kv_last_page_len), {"kv_layout": layout})


def graph_append_rows(md: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src int64, batch int32, pos int32), one row per request of a decode batch.

    Real rows append their own token; padding rows repeat row 0's write exactly.
    Raises ValueError for a batch that is not decode-only.
    """
    if not md.is_decode:
        raise ValueError("graph_append_rows: CUDA-graph append needs a decode-only batch")
    n = md.num_append_tokens
    src = torch.arange(md.batch_size, dtype=torch.int64)
    batch = md.batch_indices.clone()
    pos = md.positions.to(torch.int32)
    for row in (src, batch, pos):
        row[n:] = row[0]
    return src, batch, pos


def _import_flashinfer() -> ModuleType:
    try:
        return importlib.import_module("flashinfer")
    except ImportError as err:
        raise RuntimeError("FlashInferBackend needs the flashinfer package "
                           "(pip install -e '.[gpu]')") from err


@dataclass(frozen=True)
class _Step:
    """What one planned step's forward calls use. append_src (CUDA-graph steps) holds the
    k/v row each append row writes; without it the first num_append_tokens rows append."""

    wrapper: Any
    buffers: StepBuffers
    append_src: torch.Tensor | None


class FlashInferBackend(AttentionBackend):
    """FlashInfer ("flashinfer"): prefill wrapper for batches with a qo_len > 1, decode
    wrapper for decode-only ones, CUDA-graph decode wrappers for graph_batch_sizes.

    Raises RuntimeError without CUDA or flashinfer, ValueError for a storage dtype the
    kernels lack (fp16/bf16 only) or bad graph options. graph_max_pages caps the pages
    one graph step may reference (default: batch size times the storage's pages, which
    holds even when every request shares every page).
    """

    name: ClassVar[str] = "flashinfer"
    supports_block_reuse: ClassVar[bool] = True

    def __init__(
        self,
        *,
        graph_batch_sizes: tuple[int, ...] = (),
        graph_max_pages: int | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        **options: Unpack[BackendOptions],
    ) -> None:
        super().__init__(**options)
        storage = self.storage
        if storage.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"FlashInferBackend needs CUDA: storage is on {storage.device}, "
                               f"torch.cuda.is_available()={torch.cuda.is_available()}")
        if storage.dtype not in KERNEL_DTYPES:
            raise ValueError(f"FlashInferBackend: storage dtype {storage.dtype} is not one of "
                             f"{KERNEL_DTYPES}")
        if any(b < 1 for b in graph_batch_sizes) or len(set(graph_batch_sizes)) != len(
                graph_batch_sizes):
            raise ValueError(f"FlashInferBackend: graph_batch_sizes={graph_batch_sizes} must be "
                             f"distinct positive ints")
        self._fi = _import_flashinfer()
        self._params = KernelParams(self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                    self.page_size, self.sm_scale, self.window_left,
                                    self.logits_soft_cap, storage.dtype)
        device, layout = storage.device, storage.layout
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        tensor_cores = self._params.decode_uses_tensor_cores
        self._prefill = self._wrapper("BatchPrefillWithPagedKVCacheWrapper",
                                      prefill_wrapper_call(workspace, layout))
        self._decode = self._wrapper("BatchDecodeWithPagedKVCacheWrapper",
                                     decode_wrapper_call(workspace, layout, tensor_cores))
        self._graphs: dict[int, tuple[Any, StepBuffers, torch.Tensor]] = {}
        if graph_batch_sizes:
            pages_per_block = storage.block_size // self.page_size
            max_batch = max(graph_batch_sizes)
            capacity = (max_batch * storage.num_blocks * pages_per_block
                        if graph_max_pages is None else graph_max_pages)
            shared = StepBuffers.allocate(max_batch, capacity, device)
            shared_src = torch.zeros(max_batch, dtype=torch.int64, device=device)
            for size in graph_batch_sizes:
                views = shared.for_size(size)
                wrapper = self._wrapper("BatchDecodeWithPagedKVCacheWrapper",
                                        decode_wrapper_call(workspace, layout, tensor_cores, views))
                self._graphs[size] = (wrapper, views, shared_src[:size])
        self._step: _Step | None = None

    def _wrapper(self, cls_name: str, call: Call) -> Any:
        return getattr(self._fi, cls_name)(*call.args, **call.kwargs)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes with a CUDA-graph decode wrapper, ascending."""
        return tuple(sorted(self._graphs))

    def _plan(self, md: PagedMetadata) -> None:
        graph = self._graphs.get(md.batch_size) if md.is_decode else None
        if graph is not None:
            self._step = self._plan_graph(md, *graph)
            return
        device = self.storage.device
        n = md.num_append_tokens
        buffers = StepBuffers(
            md.kv_indptr.to(device), md.kv_indices.to(device), md.kv_last_page_len.to(device),
            md.batch_indices[:n].to(device), md.positions[:n].to(device=device, dtype=torch.int32))
        if md.is_decode:
            wrapper, call = self._decode, decode_plan_call(self._params, md, buffers.kv_indices)
        else:
            wrapper, call = self._prefill, prefill_plan_call(self._params, md, buffers.kv_indices)
        wrapper.plan(*call.args, **call.kwargs)
        self._step = _Step(wrapper, buffers, append_src=None)

    def _plan_graph(self, md: PagedMetadata, wrapper: Any, views: StepBuffers,
                    src: torch.Tensor) -> _Step:
        nnz = md.kv_indices.numel()
        if nnz > views.kv_indices.numel():
            raise ValueError(f"FlashInferBackend.plan: decode batch references {nnz} pages, more "
                             f"than graph_max_pages={views.kv_indices.numel()}")
        # A graph wrapper's plan copies indptr, indices and last_page_len into `views`.
        call = decode_plan_call(self._params, md, md.kv_indices)
        wrapper.plan(*call.args, **call.kwargs)
        for buffer, host in zip((src, views.append_batch, views.append_pos),
                                graph_append_rows(md), strict=True):
            buffer.copy_(host)
        return _Step(wrapper, views, append_src=src)

    def _current(self) -> _Step:
        assert self._step is not None, "plan() sets the step before any forward"
        return self._step

    def _append(self, layer: int, md: PagedMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        step = self._current()
        if step.append_src is not None:
            k, v = k.index_select(0, step.append_src), v.index_select(0, step.append_src)
        else:
            k, v = k[: md.num_append_tokens], v[: md.num_append_tokens]
        call = append_call(k, v, step.buffers, self.pages[layer], self.storage.layout)
        self._fi.page.append_paged_kv_cache(*call.args, **call.kwargs)

    def _attend(self, layer: int, md: PagedMetadata, q: torch.Tensor,
                return_lse: bool) -> AttentionOutput:
        call = run_call(q, self.pages[layer], return_lse)
        out = self._current().wrapper.run(*call.args, **call.kwargs)
        if return_lse:
            return AttentionOutput(out[0], out[1])
        return AttentionOutput(out, None)

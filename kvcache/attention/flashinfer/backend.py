"""FlashInfer paged attention (GPU), with CUDA-graph buffers for padded decode batches.

flashinfer is imported when the backend is constructed, never at module import; the
arguments of every call into it come from kvcache.attention.flashinfer.calls. The
kernel family ("auto", "fa2", "fa3") is the wrappers' `backend=`; `kernels` reports
what the plans resolved it to.

Per step, the plan's index arrays reach the device through one pinned staging buffer
(kvcache.attention.flashinfer.staging): one asynchronous copy instead of several blocking ones.

CUDA-graph decode: for each size in graph_batch_sizes a decode wrapper is created with
use_cuda_graph=True over views of shared device buffers (one step uses one size, so
the sizes can share them). plan() runs outside capture and refreshes the buffers; the
captured forward reads them. After each such plan, `graph_layout(size)` holds what the
captured launch depends on (kvcache.attention.flashinfer.plan_layout); the graph runner
compares it with the layout seen at capture. Padding rows must append nowhere, but a
graph needs a fixed-shape append, so each padding row repeats the write of the first
real token (same source row, same destination): a duplicate of an identical write.
Padding rows' attention outputs are undefined (see AttentionBackend).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, NamedTuple, Unpack

import torch

from kvcache.attention.base import AttentionBackend, AttentionOutput, BackendOptions
from kvcache.attention.flashinfer.calls import (
    Call,
    KernelFamily,
    KernelParams,
    PlanInputs,
    StepBuffers,
    append_call,
    check_kernel_family,
    decode_plan_call,
    decode_wrapper_call,
    graph_append_rows,
    parse_kernel_family,
    prefill_plan_call,
    prefill_wrapper_call,
    run_call,
)
from kvcache.attention.flashinfer.plan_layout import PlanLayout, resolved_family
from kvcache.attention.flashinfer.staging import PlanStaging
from kvcache.attention.metadata import PagedMetadata
from kvcache.storage.kv_storage import KvStorage

WORKSPACE_BYTES = 128 * 1024 * 1024
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class Kernels(NamedTuple):
    """The kernel families the last prefill and decode plans ran (None: none yet)."""

    prefill: str | None
    decode: str | None


def _import_flashinfer() -> ModuleType:
    try:
        return importlib.import_module("flashinfer")
    except ImportError as err:
        raise RuntimeError("FlashInferBackend needs the flashinfer package "
                           "(pip install -e '.[gpu]')") from err


def flashinfer_version(fi: ModuleType) -> str:
    """The installed flashinfer's version: its distribution's, else the module's."""
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(fi, "__version__", "unknown"))


def _check_can_run(storage: KvStorage, graph_batch_sizes: tuple[int, ...]) -> None:
    """Raise RuntimeError unless `storage` is on a CUDA device, ValueError for a storage
    dtype the kernels lack or graph batch sizes that are not distinct positive ints."""
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


@dataclass(frozen=True)
class _Step:
    """What one planned step's forward calls use. append_src (CUDA-graph steps) holds the
    k/v row each append row writes; without it the first num_append_tokens rows append."""

    wrapper: Any
    buffers: StepBuffers
    append_src: torch.Tensor | None


class _Graph(NamedTuple):
    """One CUDA-graph size: its wrapper, the persistent buffers it reads, and the
    persistent [3, size] (src, batch, pos) append rows."""

    wrapper: Any
    buffers: StepBuffers
    rows: torch.Tensor


class FlashInferBackend(AttentionBackend):
    """FlashInfer ("flashinfer"): prefill wrapper for batches with a qo_len > 1, decode
    wrapper for decode-only ones, CUDA-graph decode wrappers for graph_batch_sizes.

    kernel_family pins the prefill and tensor-core decode kernels ("fa2", "fa3") or
    leaves them to FlashInfer ("auto"); decode uses tensor cores for query groups larger
    than 2 (KernelParams.decode_uses_tensor_cores), the CUDA-core kernel otherwise.
    Raises RuntimeError without CUDA or flashinfer, ValueError for a storage dtype the
    kernels lack (fp16/bf16 only), bad graph options, or a kernel family this FlashInfer
    or GPU cannot run. graph_max_pages caps the pages one graph step may reference
    (default: batch size times the storage's pages, which holds even when every request
    shares every page). Packed (BLHNC) storage reaches FlashInfer as HND page views whose
    page stride steps over heads and layers: its kernels (FA2, FA3) and append read each
    view's strides, so nothing is copied.
    """

    name: ClassVar[str] = "flashinfer"
    supports_block_reuse: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True

    def __init__(
        self,
        *,
        graph_batch_sizes: tuple[int, ...] = (),
        graph_max_pages: int | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        kernel_family: KernelFamily = "auto",
        **options: Unpack[BackendOptions],
    ) -> None:
        super().__init__(**options)
        parse_kernel_family(kernel_family)  # a bad name fails here, even without CUDA
        _check_can_run(self.storage, graph_batch_sizes)
        self._fi = _import_flashinfer()
        device, layout = self.storage.device, self.storage.page_layout
        self.kernel_family = check_kernel_family(
            kernel_family, flashinfer_version=flashinfer_version(self._fi),
            capability=torch.cuda.get_device_capability(device), cuda_version=torch.version.cuda,
            device_name=torch.cuda.get_device_name(device))
        self._params = KernelParams(self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                    self.page_size, self.sm_scale, self.window_left,
                                    self.logits_soft_cap, self.storage.dtype)
        # FlashInfer asks for a zeroed float workspace before its first use.
        workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        tensor_cores = self._params.decode_uses_tensor_cores
        family = self.kernel_family
        self._prefill = self._wrapper("BatchPrefillWithPagedKVCacheWrapper",
                                      prefill_wrapper_call(workspace, layout, family))
        self._decode = self._wrapper("BatchDecodeWithPagedKVCacheWrapper",
                                     decode_wrapper_call(workspace, layout, tensor_cores, family))
        self._staging = PlanStaging(device)
        self._graphs = self._graph_wrappers(workspace, graph_batch_sizes, graph_max_pages)
        self._layouts: dict[int, PlanLayout] = {}
        self._kernels = Kernels(None, None)
        self._step: _Step | None = None

    def _graph_wrappers(self, workspace: torch.Tensor, sizes: tuple[int, ...],
                        max_pages: int | None) -> dict[int, _Graph]:
        """A CUDA-graph decode wrapper per batch size in `sizes`, over views of one set of
        device buffers (one step uses one size, so the sizes share them); `max_pages`
        caps the pages a step may reference (None: the largest size times the storage's
        pages)."""
        if not sizes:
            return {}
        storage, device = self.storage, self.storage.device
        max_batch = max(sizes)
        capacity = (max_batch * storage.num_blocks * (storage.block_size // self.page_size)
                    if max_pages is None else max_pages)

        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        indptr, indices, last = i32(max_batch + 1), i32(capacity), i32(max_batch)
        rows = i32(3, max_batch)
        graphs = {}
        for size in sizes:
            csr = (indptr[: size + 1], indices, last[:size])
            wrapper = self._wrapper("BatchDecodeWithPagedKVCacheWrapper", decode_wrapper_call(
                workspace, storage.page_layout, self._params.decode_uses_tensor_cores,
                self.kernel_family, graph=csr))
            graphs[size] = _Graph(wrapper, StepBuffers(*csr, rows[1, :size], rows[2, :size]),
                                  rows[:, :size])
        return graphs

    def _wrapper(self, cls_name: str, call: Call) -> Any:
        return getattr(self._fi, cls_name)(*call.args, **call.kwargs)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes with a CUDA-graph decode wrapper, ascending."""
        return tuple(sorted(self._graphs))

    @property
    def kernels(self) -> Kernels:
        """The kernel families the latest prefill and decode plans resolved to."""
        return self._kernels

    def graph_layout(self, batch_size: int) -> PlanLayout:
        """The plan layout of the CUDA-graph wrapper of `batch_size` as of its latest plan:
        a graph captured under another layout must not be replayed. Raises ValueError
        for a size without a graph wrapper or not planned yet."""
        if batch_size not in self._layouts:
            raise ValueError(f"FlashInferBackend.graph_layout: batch size {batch_size} has no "
                             f"planned CUDA-graph wrapper (sizes {self.graph_batch_sizes})")
        return self._layouts[batch_size]

    def _plan(self, md: PagedMetadata) -> None:
        graph = self._graphs.get(md.batch_size) if md.is_decode else None
        self._step = self._plan_graph(md, graph) if graph is not None else self._plan_eager(md)
        family = resolved_family(self._step.wrapper)
        kept = self._kernels
        self._kernels = (Kernels(kept.prefill, family) if md.is_decode
                         else Kernels(family, kept.decode))

    def _plan_eager(self, md: PagedMetadata) -> _Step:
        n = md.num_append_tokens
        staged = self._staging.stage([md.qo_indptr, md.kv_indptr, md.kv_last_page_len,
                                      md.kv_indices, md.batch_indices[:n], md.kv_positions[:n]])
        qo_h, indptr_h, last_h = staged.host[:3]
        _, indptr_d, last_d, indices_d, batch_d, pos_d = staged.device
        inputs = PlanInputs(qo_h, indptr_h, indices_d, last_h)
        if md.is_decode:
            wrapper, call = self._decode, decode_plan_call(self._params, inputs)
        else:
            wrapper, call = self._prefill, prefill_plan_call(self._params, inputs)
        wrapper.plan(*call.args, **call.kwargs)
        self._staging.release()
        return _Step(wrapper, StepBuffers(indptr_d, indices_d, last_d, batch_d, pos_d),
                     append_src=None)

    def _plan_graph(self, md: PagedMetadata, graph: _Graph) -> _Step:
        nnz, capacity = md.kv_indices.numel(), graph.buffers.kv_indices.numel()
        if nnz > capacity:
            raise ValueError(f"FlashInferBackend.plan: decode batch references {nnz} pages, more "
                             f"than graph_max_pages={capacity}")
        staged = self._staging.stage([md.kv_indptr, md.kv_last_page_len, md.kv_indices,
                                      graph_append_rows(md).flatten()])
        inputs = PlanInputs(md.qo_indptr, staged.host[0], staged.device[2], staged.host[1])
        # A graph wrapper's plan copies indptr, indices and last_page_len into its buffers.
        call = decode_plan_call(self._params, inputs)
        graph.wrapper.plan(*call.args, **call.kwargs)
        graph.rows.copy_(staged.device[3].view(graph.rows.shape), non_blocking=True)
        self._staging.release()
        self._layouts[md.batch_size] = PlanLayout.of(graph.wrapper)
        return _Step(graph.wrapper, graph.buffers, append_src=graph.rows[0])

    def _current(self) -> _Step:
        assert self._step is not None, "plan() sets the step before any forward"
        return self._step

    def _append(self, layer: int, md: PagedMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        step = self._current()
        if step.append_src is not None:
            k, v = k.index_select(0, step.append_src), v.index_select(0, step.append_src)
        else:
            k, v = k[: md.num_append_tokens], v[: md.num_append_tokens]
        call = append_call(k, v, step.buffers, self.pages[layer], self.storage.page_layout)
        self._fi.page.append_paged_kv_cache(*call.args, **call.kwargs)

    def _attend(self, layer: int, md: PagedMetadata, q: torch.Tensor,
                return_lse: bool) -> AttentionOutput:
        call = run_call(q, self.pages[layer], return_lse)
        out = self._current().wrapper.run(*call.args, **call.kwargs)
        if return_lse:
            return AttentionOutput(out[0], out[1])
        return AttentionOutput(out, None)

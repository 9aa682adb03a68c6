"""Every call the FlashInfer backend makes into flashinfer, as pure functions of its inputs.

Each builder returns the call's arguments (`Call`), so CPU tests bind them to the
installed package's signatures and to FlashInfer 0.6.0's. Calls pass only keywords that
FlashInfer 0.6.x and 0.7.x both accept. `check_kernel_family` validates the kernel
family the wrappers are pinned to, before any wrapper exists.

Kernel families, and why they are pinned: with backend="auto" the kernels depend on the
release. On Hopper, 0.6.x prefill takes FA3 for every batch; 0.7.x takes FA2 whenever
the longest query of the batch is at most 64 tokens. Tensor-core decode (a prefill
kernel with qo_len 1) took FA3 on Hopper up to 0.6.3 and FA2 since 0.6.4. "fa2" and
"fa3" make the choice explicit; the CUDA-core decode kernel (small query groups) is
neither and ignores it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch

from kvcache.attention.metadata import PagedMetadata
from kvcache.storage.layouts import PageLayout

KernelFamily = Literal["auto", "fa2", "fa3"]
KERNEL_FAMILIES: tuple[KernelFamily, ...] = get_args(KernelFamily)
MIN_FLASHINFER = (0, 6)
# FA3 kernels are built for sm_90a, which needs a CUDA 12.3+ toolkit (FlashInfer's own
# is_sm90a_supported check).
FA3_MIN_CUDA = (12, 3)


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def parse_kernel_family(family: object) -> KernelFamily:
    """`family` as a KernelFamily; ValueError naming it when it is not one."""
    for known in KERNEL_FAMILIES:
        if family == known:
            return known
    raise ValueError(f"kernel_family={family!r} is not one of {', '.join(KERNEL_FAMILIES)}")


def check_kernel_family(family: str, *, flashinfer_version: str,
                        capability: tuple[int, int], cuda_version: str | None,
                        device_name: str) -> KernelFamily:
    """`family` as a KernelFamily, once the installed FlashInfer and the GPU can run it.

    Raises ValueError naming the value and the reason: a family outside KERNEL_FAMILIES,
    a FlashInfer older than MIN_FLASHINFER, or "fa3" on a GPU whose compute capability
    is not 9.x (FA3 is Hopper-only) or with a torch built for CUDA older than 12.3.
    """
    family = parse_kernel_family(family)
    installed = _major_minor(flashinfer_version)
    if installed is None or installed < MIN_FLASHINFER:
        raise ValueError(f"kernel_family={family!r}: flashinfer {flashinfer_version} is "
                         f"installed; this backend needs flashinfer >= "
                         f"{'.'.join(map(str, MIN_FLASHINFER))}")
    if family != "fa3":
        return family
    if capability[0] != 9:
        raise ValueError(f"kernel_family='fa3' needs a Hopper GPU (compute capability 9.x); "
                         f"{device_name} has {capability[0]}.{capability[1]}: use 'fa2' or "
                         f"'auto'")
    cuda = _major_minor(cuda_version or "")
    if cuda is None or cuda < FA3_MIN_CUDA:
        raise ValueError(f"kernel_family='fa3' needs torch built for CUDA >= "
                         f"{'.'.join(map(str, FA3_MIN_CUDA))} (sm_90a kernels); this torch "
                         f"is built for CUDA {cuda_version}")
    return "fa3"


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


class PlanInputs(NamedTuple):
    """The CSR a plan reads. FlashInfer schedules on the host, so the indptrs and
    last_page_len must be host tensors (pinned ones make its own copies asynchronous);
    kv_indices may live on either side (on the device its copy is device-to-device)."""

    qo_indptr: torch.Tensor       # int32 [B + 1] (prefill only)
    kv_indptr: torch.Tensor       # int32 [B + 1]
    kv_indices: torch.Tensor      # int32 [nnz]
    kv_last_page_len: torch.Tensor  # int32 [B]

    @classmethod
    def of(cls, md: PagedMetadata) -> PlanInputs:
        """The metadata's own (host) tensors."""
        return cls(md.qo_indptr, md.kv_indptr, md.kv_indices, md.kv_last_page_len)


class StepBuffers(NamedTuple):
    """Device metadata one step's append and attention read (int32, contiguous)."""

    kv_indptr: torch.Tensor      # [B + 1]
    kv_indices: torch.Tensor     # [nnz], or a CUDA-graph buffer's whole capacity
    kv_last_page_len: torch.Tensor  # [B]
    append_batch: torch.Tensor   # [rows]: request of each appended row
    append_pos: torch.Tensor     # [rows]: its position in that request


def prefill_wrapper_call(workspace: torch.Tensor, layout: PageLayout,
                         family: KernelFamily) -> Call:
    """BatchPrefillWithPagedKVCacheWrapper(...) over the shared float workspace."""
    return Call((workspace,), {"kv_layout": layout, "backend": family})


def decode_wrapper_call(workspace: torch.Tensor, layout: PageLayout, use_tensor_cores: bool,
                        family: KernelFamily,
                        graph: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                        ) -> Call:
    """BatchDecodeWithPagedKVCacheWrapper(...); with `graph` (persistent device kv_indptr,
    kv_indices, kv_last_page_len buffers), a CUDA-graph wrapper whose plan() copies the
    metadata into them."""
    kwargs: dict[str, Any] = {"kv_layout": layout, "use_tensor_cores": use_tensor_cores,
                              "backend": family}
    if graph is not None:
        kwargs.update(use_cuda_graph=True, paged_kv_indptr_buffer=graph[0],
                      paged_kv_indices_buffer=graph[1], paged_kv_last_page_len_buffer=graph[2])
    return Call((workspace,), kwargs)


def _plan_options(p: KernelParams) -> dict[str, Any]:
    return {"pos_encoding_mode": "NONE", "window_left": p.window_left,
            "logits_soft_cap": p.logits_soft_cap, "sm_scale": p.sm_scale,
            "q_data_type": p.dtype, "kv_data_type": p.dtype, "non_blocking": True}


def prefill_plan_call(p: KernelParams, inputs: PlanInputs) -> Call:
    """prefill.plan(...): causal (bottom-right), over `inputs`."""
    return Call((inputs.qo_indptr, inputs.kv_indptr, inputs.kv_indices,
                 inputs.kv_last_page_len, p.num_qo_heads, p.num_kv_heads, p.head_dim,
                 p.page_size), {"causal": True, **_plan_options(p)})


def decode_plan_call(p: KernelParams, inputs: PlanInputs) -> Call:
    """decode.plan(...) over `inputs` (its qo_indptr is unused: one query per request)."""
    return Call((inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len,
                 p.num_qo_heads, p.num_kv_heads, p.head_dim, p.page_size), _plan_options(p))


def run_call(q: torch.Tensor, kv_pages: tuple[torch.Tensor, torch.Tensor],
             return_lse: bool) -> Call:
    """wrapper.run(q, (k_pages, v_pages)); with return_lse it returns (o, lse base 2)."""
    return Call((q, kv_pages), {"return_lse": return_lse})


def append_call(k: torch.Tensor, v: torch.Tensor, buffers: StepBuffers,
                kv_pages: tuple[torch.Tensor, torch.Tensor], layout: PageLayout) -> Call:
    """flashinfer.page.append_paged_kv_cache(...): row i of k/v goes to request
    append_batch[i] at position append_pos[i], through the step's device CSR."""
    return Call((k, v, buffers.append_batch, buffers.append_pos, kv_pages, buffers.kv_indices,
                 buffers.kv_indptr, buffers.kv_last_page_len), {"kv_layout": layout})


def graph_append_rows(md: PagedMetadata) -> torch.Tensor:
    """int32 [3, B]: for each request of a decode batch, the k/v row it appends (src),
    the request (batch) and the position among its listed keys (pos).

    Real rows append their own token; padding rows repeat row 0's write exactly (same
    source, same destination), because a captured append has a fixed shape.
    Raises ValueError for a batch that is not decode-only.
    """
    if not md.is_decode:
        raise ValueError("graph_append_rows: CUDA-graph append needs a decode-only batch")
    rows = torch.stack([torch.arange(md.batch_size, dtype=torch.int32),
                        md.batch_indices.to(torch.int32), md.kv_positions.to(torch.int32)])
    rows[:, md.num_append_tokens:] = rows[:, :1]
    return rows

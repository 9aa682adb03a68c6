"""What the GPU tests share: paired storages, the kernel families, and measured comparisons.

A `Pair` is the same paged storage twice, on the CPU for the torch reference and on
CUDA for FlashInfer, with a block table over it. `Measure` compares tensors like
torch.testing.assert_close and also records each comparison's max absolute error and
tolerance, and the kernels that ran, as the test's user properties: junit XML and the
GPU check's report (harness.gpu_check) show them next to pass/fail.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvcache.attention import BlockTable, PagedMetadata, build_metadata
from kvcache.attention.flashinfer.backend import FlashInferBackend, flashinfer_version
from kvcache.attention.flashinfer.calls import KERNEL_FAMILIES, KernelFamily, check_kernel_family
from kvcache.attention.reference import ReferenceBackend
from kvcache.storage.kv_storage import KvLayout, KvStorage

# atol = rtol per dtype against the float32 reference: a few ULPs of the output, since
# the kernels round P to the input dtype before P @ V. Soft-capping adds FlashInfer's
# approximate tanh. Estimates until GPU runs calibrate them (the report shows margins).
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SOFT_CAP_TOL_SCALE = 2.5
BLOCK = 16
FAMILIES = [pytest.param(f, id=f) for f in KERNEL_FAMILIES]
LAYOUTS = [pytest.param("NHD", id="nhd"), pytest.param("HND", id="hnd"),
           pytest.param("BLHNC", id="blhnc")]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
PAGES = [pytest.param(16, id="p16"), pytest.param(4, id="b16p4")]
# Query heads per KV head: 2 takes FlashInfer's CUDA-core decode kernel, 4 its
# tensor-core (prefill) kernel (KernelParams.decode_uses_tensor_cores).
DECODE_PATHS = [pytest.param(4, id="cuda-cores"), pytest.param(8, id="tensor-cores")]


def family_or_skip(family: KernelFamily) -> KernelFamily:
    """`family` where this GPU and FlashInfer run it; skips "fa3" with the reason where
    they cannot (any other refusal is a failure)."""
    try:
        return check_kernel_family(
            family, flashinfer_version=flashinfer_version(importlib.import_module("flashinfer")),
            capability=torch.cuda.get_device_capability(), cuda_version=torch.version.cuda,
            device_name=torch.cuda.get_device_name())
    except ValueError as err:
        if family != "fa3":
            raise
        pytest.skip(str(err))


class Measure:
    """Comparisons that record what they measured into a test's user properties."""

    def __init__(self, properties: list[tuple[str, object]]) -> None:
        self._properties = properties

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        """assert_close(got, want, rtol=atol=tol) on the CPU; records the max abs error."""
        got, want = got.detach().float().cpu(), want.detach().float().cpu()
        err = (got - want).abs().max().item() if got.numel() else 0.0
        self._properties.append(("check", json.dumps(
            {"what": what, "max_abs_err": err, "tol": tol})))
        torch.testing.assert_close(got, want, rtol=tol, atol=tol,
                                   msg=lambda m: f"{what}: {m}")

    def kernels(self, backend: FlashInferBackend) -> None:
        """Record which kernel families the backend's latest plans ran."""
        k = backend.kernels
        self._properties.append(("kernels", f"prefill={k.prefill} decode={k.decode}"))

    def note(self, name: str, value: Any) -> None:
        self._properties.append((name, json.dumps(value)))


@dataclass
class Pair:
    """The same storage twice (CPU, CUDA) and a block table over it."""

    cpu: KvStorage
    gpu: KvStorage
    table: BlockTable
    slots: list[int]

    def metadata(self, requests: list[tuple[int, int]], page_size: int,
                 pad_to: int | None = None) -> PagedMetadata:
        return build_metadata(self.table, self.slots[: len(requests)],
                              [c for c, _ in requests], [n for _, n in requests],
                              block_size=BLOCK, page_size=page_size,
                              page_index_multiplier=self.cpu.page_index_multiplier(page_size),
                              pad_to=pad_to)

    def assert_same_storage(self) -> None:
        for name in ("k", "v"):
            for layer, (a, b) in enumerate(zip(getattr(self.cpu, name), getattr(self.gpu, name),
                                               strict=True)):
                assert torch.equal(a, b.cpu()), f"{name}[{layer}] differs after the append"


def make_pair(max_tokens: list[int], layout: KvLayout, dtype: torch.dtype,
              num_kv_heads: int = 2, head_dim: int = 128, seed: int = 0,
              num_layers: int = 2) -> Pair:
    """Storage for requests of up to max_tokens[i] tokens, filled with noise, each
    request's blocks scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) + 1 for n in max_tokens]
    num_blocks = sum(need) + 4
    args = dict(num_layers=num_layers, num_blocks=num_blocks, block_size=BLOCK,
                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, layout=layout)
    cpu = KvStorage(**args)  # type: ignore[arg-type]
    gpu = KvStorage(**args, device="cuda")  # type: ignore[arg-type]
    for a, b in zip((*cpu.k, *cpu.v), (*gpu.k, *gpu.v), strict=True):
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(a)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    slots = torch.randperm(len(max_tokens) + 3, generator=gen)[: len(max_tokens)].tolist()
    table = BlockTable(len(max_tokens) + 3, max(need))
    for slot, count in zip(slots, need, strict=True):
        table.assign(slot, perm[:count])
        perm = perm[count:]
    return Pair(cpu, gpu, table, slots)


def random_qkv(T: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, h, head_dim, generator=gen).to(dtype)
                 for h in (num_qo_heads, num_kv_heads, num_kv_heads))


def backends(pair: Pair, page_size: int, num_qo_heads: int = 8, family: KernelFamily = "auto",
             graph_batch_sizes: tuple[int, ...] = (), **options: object
             ) -> tuple[FlashInferBackend, ReferenceBackend]:
    """FlashInfer over pair.gpu and the reference over pair.cpu with the same attention
    `options` (window_left, logits_soft_cap); family and graph sizes are FlashInfer's."""
    common = dict(num_qo_heads=num_qo_heads, num_kv_heads=pair.cpu.num_kv_heads,
                  head_dim=pair.cpu.head_dim, page_size=page_size) | options
    return (FlashInferBackend(storage=pair.gpu, kernel_family=family,  # type: ignore[arg-type]
                              graph_batch_sizes=graph_batch_sizes, **common),
            ReferenceBackend(storage=pair.cpu, **common))  # type: ignore[arg-type]


def compare_step(measure: Measure, pair: Pair, md: PagedMetadata, fi: FlashInferBackend,
                 ref: ReferenceBackend, *, layer: int, dtype: torch.dtype, seed: int,
                 tol: float | None = None, what: str = "step") -> None:
    """One step through both backends: outputs and LSE of the real rows (padding rows
    are undefined), then the storages after the append."""
    q, k, v = random_qkv(md.num_tokens, ref.num_qo_heads, ref.num_kv_heads, ref.head_dim,
                         dtype, seed)
    ref.plan(md)
    want = ref.forward_with_lse(layer, q, k, v)
    fi.plan(md)
    got = fi.forward_with_lse(layer, q.cuda(), k.cuda(), v.cuda())
    assert got.lse is not None and want.lse is not None
    tol = TOL[dtype] if tol is None else tol
    real = int(md.qo_indptr[md.num_requests])
    measure.close(f"{what} o", got.o[:real], want.o[:real], tol)
    measure.close(f"{what} lse", got.lse[:real], want.lse[:real], tol)
    measure.kernels(fi)
    pair.assert_same_storage()


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm `fn` up on a side stream (JIT, workspace), then capture it: (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out

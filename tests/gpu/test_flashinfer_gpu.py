"""FlashInfer backend against the torch reference on identical metadata and storage.

Each case builds two storages with the same contents (CPU for the reference, CUDA for
FlashInfer), runs one step through both backends and compares the outputs, the LSE
and the storage after the append. The CUDA-graph case captures the backend's decode
forward once and replays it after a re-plan that changes page counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvcache.attention import BlockTable, PagedMetadata, build_metadata
from kvcache.attention.flashinfer import FlashInferBackend
from kvcache.attention.reference import ReferenceBackend
from kvcache.storage.kv_storage import KvLayout, KvStorage

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer]

TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
BLOCK = 16
LAYOUTS = [pytest.param("NHD", id="nhd"), pytest.param("HND", id="hnd")]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
PAGES = [pytest.param(16, id="p16"), pytest.param(4, id="b16p4")]
# (cached, new): cached prefixes off page boundaries, one on a boundary, empty ones.
PREFILL = [(0, 37), (21, 11), (32, 1), (5, 64), (47, 3)]
DECODE = [(21, 1), (32, 1), (0, 1), (63, 1), (100, 1)]


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
              num_kv_heads: int = 2, head_dim: int = 128, seed: int = 0) -> Pair:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) + 1 for n in max_tokens]
    num_blocks = sum(need) + 4
    args = dict(num_layers=2, num_blocks=num_blocks, block_size=BLOCK,
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


def compare_step(pair: Pair, md: PagedMetadata, fi: FlashInferBackend, ref: ReferenceBackend,
                 layer: int, dtype: torch.dtype, seed: int) -> None:
    q, k, v = random_qkv(md.num_tokens, ref.num_qo_heads, ref.num_kv_heads, ref.head_dim,
                         dtype, seed)
    ref.plan(md)
    want = ref.forward_with_lse(layer, q, k, v)
    fi.plan(md)
    got = fi.forward_with_lse(layer, q.cuda(), k.cuda(), v.cuda())
    assert got.lse is not None and want.lse is not None
    tol = TOL[dtype]
    torch.testing.assert_close(got.o.cpu(), want.o, rtol=tol, atol=tol)
    real = md.qo_indptr[md.num_requests].item()  # padding rows' lse is -inf in both
    torch.testing.assert_close(got.lse.cpu()[:real], want.lse[:real], rtol=tol, atol=tol)
    pair.assert_same_storage()


def backends(pair: Pair, page_size: int, num_qo_heads: int = 8,
             **options: object) -> tuple[FlashInferBackend, ReferenceBackend]:
    common = dict(num_qo_heads=num_qo_heads, num_kv_heads=pair.cpu.num_kv_heads,
                  head_dim=pair.cpu.head_dim, page_size=page_size) | options
    return (FlashInferBackend(storage=pair.gpu, **common),  # type: ignore[arg-type]
            ReferenceBackend(storage=pair.cpu, **common))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("requests", [pytest.param(PREFILL, id="prefill"),
                                      pytest.param(DECODE, id="decode")])
def test_matches_reference(requests: list[tuple[int, int]], layout: KvLayout, page_size: int,
                           dtype: torch.dtype) -> None:
    pair = make_pair([c + n for c, n in requests], layout, dtype)
    fi, ref = backends(pair, page_size)
    compare_step(pair, pair.metadata(requests, page_size), fi, ref, layer=1, dtype=dtype, seed=1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("options", [
    pytest.param(dict(window_left=20), id="window20"),
    pytest.param(dict(logits_soft_cap=5.0), id="softcap5"),
])
def test_window_and_soft_cap_match_reference(layout: KvLayout, options: dict) -> None:
    pair = make_pair([c + n for c, n in PREFILL], layout, torch.float16)
    fi, ref = backends(pair, 4, **options)
    compare_step(pair, pair.metadata(PREFILL, 4), fi, ref, layer=0, dtype=torch.float16, seed=2)
    compare_step(pair, pair.metadata([(c + n, 1) for c, n in PREFILL], 4), fi, ref, layer=0,
                 dtype=torch.float16, seed=3)


@pytest.mark.parametrize("num_qo_heads", [pytest.param(2, id="cuda-cores"),
                                          pytest.param(8, id="tensor-cores")])
def test_padded_eager_decode_matches_reference(num_qo_heads: int) -> None:
    pair = make_pair([c + n for c, n in DECODE], "NHD", torch.bfloat16)
    fi, ref = backends(pair, 16, num_qo_heads=num_qo_heads)
    md = pair.metadata(DECODE, 16, pad_to=7)
    compare_step(pair, md, fi, ref, layer=0, dtype=torch.bfloat16, seed=4)


@pytest.mark.cuda_graph
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graph_decode_replays_after_page_counts_change(layout: KvLayout,
                                                            page_size: int) -> None:
    dtype, batch, layer = torch.float16, 8, 1
    steps = [
        [(15, 1), (31, 1), (7, 1), (0, 1), (40, 1)],    # 5 real + 3 padding
        [(16, 1), (32, 1), (8, 1), (1, 1), (41, 1)],    # two requests cross a page
        [(47, 1), (3, 1), (64, 1)],                     # fewer requests, new lengths
    ]
    pair = make_pair([80] * 5, layout, dtype)
    fi, ref = backends(pair, page_size, graph_batch_sizes=(4, batch))
    H, Hkv, D = ref.num_qo_heads, ref.num_kv_heads, ref.head_dim
    q_s = torch.zeros(batch, H, D, dtype=dtype, device="cuda")
    k_s = torch.zeros(batch, Hkv, D, dtype=dtype, device="cuda")
    v_s = torch.zeros_like(k_s)

    def load(md: PagedMetadata, seed: int) -> torch.Tensor:
        q, k, v = random_qkv(batch, H, Hkv, D, dtype, seed)
        ref.plan(md)
        want = ref.forward(layer, q, k, v)
        fi.plan(md)  # outside capture: refreshes the graph buffers
        for static, new in ((q_s, q), (k_s, k), (v_s, v)):
            static.copy_(new)
        return want

    want = load(pair.metadata(steps[0], page_size, pad_to=batch), seed=10)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (JIT, workspace) before capture
        fi.forward(layer, q_s, k_s, v_s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi.forward(layer, q_s, k_s, v_s)
    for i, requests in enumerate(steps):
        if i:
            want = load(pair.metadata(requests, page_size, pad_to=batch), seed=10 + i)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu(), want, rtol=TOL[dtype], atol=TOL[dtype],
                                   msg=lambda m, i=i: f"step {i}: {m}")
        pair.assert_same_storage()

"""FlashInfer reading the packed BLHNC layout on the GPU.

Packed and per-layer HND storages with the same contents, read through the same
metadata: FlashInfer must return the same outputs and write the same storage in every
layer, with and without re-paging, per kernel family (the kernels read the same values
through other strides). Releasing the packed storage frees its GPU memory while the
backend lives. (The packed layout against the torch reference, and under CUDA graphs,
runs in test_flashinfer_gpu.py and test_graphs_gpu.py through support.LAYOUTS.)
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvcache.attention import PagedMetadata
from kvcache.attention.flashinfer.backend import FlashInferBackend
from kvcache.attention.flashinfer.calls import KernelFamily
from kvcache.storage.kv_storage import KvStorage
from tests.gpu.support import BLOCK, DTYPES, FAMILIES, PAGES, family_or_skip, make_pair, random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer]

LAYERS = 3
# (cached, new): prefixes ending mid-page and on a boundary; queries on both sides of 64.
PREFILL = [(0, 37), (21, 11), (32, 1), (5, 100), (47, 3)]
DECODE = [(21, 1), (32, 1), (0, 1), (63, 1), (100, 1)]


def _copy_into_packed(per_layer: KvStorage) -> KvStorage:
    packed = KvStorage(num_layers=per_layer.num_layers, num_blocks=per_layer.num_blocks,
                       block_size=per_layer.block_size, num_kv_heads=per_layer.num_kv_heads,
                       head_dim=per_layer.head_dim, dtype=per_layer.dtype, device="cuda",
                       layout="BLHNC")
    for dst, src in zip((*packed.k, *packed.v), (*per_layer.k, *per_layer.v), strict=True):
        dst.copy_(src)  # both [num_blocks, H, block_size, D] per layer
    return packed


def _backend(storage: KvStorage, page_size: int, family: KernelFamily) -> FlashInferBackend:
    return FlashInferBackend(storage=storage, num_qo_heads=8, num_kv_heads=storage.num_kv_heads,
                             head_dim=storage.head_dim, page_size=page_size,
                             kernel_family=family)


def _step(backend: FlashInferBackend, md: PagedMetadata, seed: int) -> list[torch.Tensor]:
    backend.plan(md)
    outs = []
    for layer in range(LAYERS):
        q, k, v = random_qkv(md.num_tokens, 8, backend.num_kv_heads, backend.head_dim,
                             backend.storage.dtype, seed + layer)
        outs.append(backend.forward(layer, q.cuda(), k.cuda(), v.cuda()))
    return outs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGES)
def test_packed_reads_and_writes_as_per_layer_hnd(page_size: int, dtype: torch.dtype,
                                                  family: KernelFamily) -> None:
    family = family_or_skip(family)
    pair = make_pair([c + n for c, n in PREFILL], "HND", dtype, num_layers=LAYERS)
    packed = _copy_into_packed(pair.gpu)
    assert packed.page_index_multiplier(page_size) == (
        1 if page_size == BLOCK else LAYERS * packed.num_kv_heads * BLOCK // page_size)
    per_layer_fi = _backend(pair.gpu, page_size, family)
    packed_fi = _backend(packed, page_size, family)
    steps = [PREFILL, [(c + n, 1) for c, n in PREFILL]]  # prefill, then decode one token
    for i, requests in enumerate(steps):
        md = pair.metadata(requests, page_size)  # one kv_indices for every layer
        want, got = _step(per_layer_fi, md, 10 * i), _step(packed_fi, md, 10 * i)
        real = int(md.qo_indptr[md.num_requests])
        for layer in range(LAYERS):
            assert torch.equal(got[layer][:real], want[layer][:real]), f"step {i} layer {layer}"
        for name in ("k", "v"):
            for layer, (a, b) in enumerate(zip(getattr(packed, name), getattr(pair.gpu, name),
                                               strict=True)):
                assert torch.equal(a, b), f"step {i}: {name}[{layer}] after the append"


@pytest.mark.parametrize("num_qo_heads", [pytest.param(4, id="cuda-cores"),
                                          pytest.param(8, id="tensor-cores")])
def test_padded_decode_over_packed_pages_matches_per_layer(num_qo_heads: int) -> None:
    pair = make_pair([c + n for c, n in DECODE], "HND", torch.float16, num_layers=LAYERS)
    packed = _copy_into_packed(pair.gpu)
    md = pair.metadata(DECODE, 4, pad_to=7)
    common = dict(num_qo_heads=num_qo_heads, num_kv_heads=2, head_dim=128, page_size=4)
    per_layer_fi = FlashInferBackend(storage=pair.gpu, **common)  # type: ignore[arg-type]
    packed_fi = FlashInferBackend(storage=packed, **common)  # type: ignore[arg-type]
    for backend in (per_layer_fi, packed_fi):
        backend.plan(md)
    for layer in range(LAYERS):
        q, k, v = (t.cuda() for t in random_qkv(md.num_tokens, num_qo_heads, 2, 128,
                                                torch.float16, layer))
        want, got = per_layer_fi.forward(layer, q, k, v), packed_fi.forward(layer, q, k, v)
        assert torch.equal(got[: len(DECODE)], want[: len(DECODE)]), f"layer {layer}"


def test_release_frees_gpu_memory_while_the_backend_lives() -> None:
    """The seed's 'clear_layer_kv_caches releases read views' on the device."""
    pair = make_pair([c + n for c, n in PREFILL], "HND", torch.float16, num_layers=LAYERS)
    packed = _copy_into_packed(pair.gpu)
    backend = _backend(packed, 4, "auto")
    md = pair.metadata(PREFILL, 4)
    _step(backend, md, seed=5)
    torch.cuda.synchronize()
    nbytes = sum(t.untyped_storage().nbytes() for t in packed.tensors)
    before = torch.cuda.memory_allocated()
    packed.release()
    gc.collect()
    assert torch.cuda.memory_allocated() <= before - nbytes, "a view kept the storage alive"
    q, k, v = (t.cuda() for t in random_qkv(md.num_tokens, 8, 2, 128, torch.float16, 6))
    with pytest.raises(RuntimeError, match="KvStorage was released"):
        backend.forward(0, q, k, v)

"""FlashInfer backend against the torch reference on identical metadata and storage.

Each case builds two storages with the same contents (CPU for the reference, CUDA for
FlashInfer), runs steps through both backends and compares the real rows' outputs and
LSE (padding rows are undefined), then the storages after the append. Cases run per
kernel family ("auto", "fa2", "fa3"; fa3 only on Hopper): FlashInfer 0.7 takes FA2 for
prefills whose longest query is at most 64 tokens and FA3 above that on Hopper, so the
prefills here cover both sides of 64, after cached prefixes that end mid-page.
CUDA-graph replay is in test_graphs_gpu.py, the engine in test_engine_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from kvcache.attention.flashinfer.backend import FlashInferBackend
from kvcache.attention.flashinfer.calls import KernelFamily
from kvcache.attention.layer_windows import LayerWindows, backend_for_windows
from kvcache.attention.reference import ReferenceBackend
from kvcache.storage.kv_storage import KvLayout
from tests.gpu.support import (
    BLOCK,
    DECODE_PATHS,
    DTYPES,
    FAMILIES,
    LAYOUTS,
    PAGES,
    SOFT_CAP_TOL_SCALE,
    TOL,
    Measure,
    backends,
    compare_step,
    family_or_skip,
    make_pair,
    random_qkv,
)

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer]

# (cached, new): cached prefixes off page boundaries, one on a boundary, empty ones;
# the longest query is 64 tokens (FA2 under 0.7's auto).
PREFILL = [(0, 37), (21, 11), (32, 1), (5, 64), (47, 3)]
DECODE = [(21, 1), (32, 1), (0, 1), (63, 1), (100, 1)]
# Queries longer than 64 tokens after non-aligned prefixes (FA3 under auto on Hopper).
LONG_PREFILL = [(21, 100), (37, 65), (5, 130), (0, 200), (13, 2)]
# One request prefilled over four steps beside one that decodes: chunks above and below
# 64 tokens, each starting where the last one stopped (mid-page).
CHUNKS = [37, 70, 5, 90]
WINDOWS = [20, -1]  # storage layer -> window_left: a windowed layer, then a full one

STEPS = [pytest.param(PREFILL, 8, id="prefill"),
         pytest.param(DECODE, 4, id="decode-cuda-cores"),
         pytest.param(DECODE, 8, id="decode-tensor-cores")]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("requests", "num_qo_heads"), STEPS)
def test_matches_reference(measure: Measure, requests: list[tuple[int, int]],
                           num_qo_heads: int, layout: KvLayout, page_size: int,
                           dtype: torch.dtype, family: KernelFamily) -> None:
    family = family_or_skip(family)
    pair = make_pair([c + n for c, n in requests], layout, dtype)
    fi, ref = backends(pair, page_size, num_qo_heads, family)
    compare_step(measure, pair, pair.metadata(requests, page_size), fi, ref, layer=1,
                 dtype=dtype, seed=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_long_prefill_after_unaligned_prefix(measure: Measure, layout: KvLayout,
                                             page_size: int, dtype: torch.dtype,
                                             family: KernelFamily) -> None:
    family = family_or_skip(family)
    pair = make_pair([c + n for c, n in LONG_PREFILL], layout, dtype)
    fi, ref = backends(pair, page_size, 8, family)
    compare_step(measure, pair, pair.metadata(LONG_PREFILL, page_size), fi, ref, layer=0,
                 dtype=dtype, seed=5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_prefill_matches_reference(measure: Measure, layout: KvLayout,
                                           page_size: int, dtype: torch.dtype,
                                           family: KernelFamily) -> None:
    """Each chunk attends to the keys earlier chunks appended: a wrong append or a wrong
    page of the cached part shows up in the next step."""
    family = family_or_skip(family)
    decoder_start = 29
    pair = make_pair([sum(CHUNKS), decoder_start + len(CHUNKS)], layout, dtype)
    fi, ref = backends(pair, page_size, 8, family)
    done = 0
    for step, chunk in enumerate(CHUNKS):
        md = pair.metadata([(done, chunk), (decoder_start + step, 1)], page_size)
        compare_step(measure, pair, md, fi, ref, layer=step % 2, dtype=dtype, seed=20 + step,
                     what=f"chunk {step} ({done}+{chunk})")
        done += chunk


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("options", "tol"), [
    pytest.param(dict(window_left=20), TOL[torch.float16], id="window20"),
    pytest.param(dict(logits_soft_cap=5.0), TOL[torch.float16] * SOFT_CAP_TOL_SCALE,
                 id="softcap5"),
])
def test_window_and_soft_cap_match_reference(measure: Measure, layout: KvLayout,
                                             options: dict, tol: float,
                                             family: KernelFamily) -> None:
    family = family_or_skip(family)
    requests = PREFILL + LONG_PREFILL[:2]
    decode = [(c + n, 1) for c, n in requests]
    for num_qo_heads in (4, 8):  # decode on CUDA cores, then on tensor cores
        pair = make_pair([c + n for c, n in decode], layout, torch.float16)
        fi, ref = backends(pair, 4, num_qo_heads, family, **options)
        compare_step(measure, pair, pair.metadata(requests, 4), fi, ref, layer=0,
                     dtype=torch.float16, seed=2, tol=tol, what=f"prefill h{num_qo_heads}")
        compare_step(measure, pair, pair.metadata(decode, 4), fi, ref, layer=1,
                     dtype=torch.float16, seed=3, tol=tol, what=f"decode h{num_qo_heads}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_windows_match_reference(measure: Measure, layout: KvLayout) -> None:
    """A windowed and a full-attention layer in one step, as a mixed-window model runs:
    one FlashInfer backend per window, both planned with the step's metadata, each
    layer's output and append against the reference's LayerWindows."""
    requests = PREFILL + LONG_PREFILL[:2]
    decode = [(c + n, 1) for c, n in requests]
    pair = make_pair([c + n for c, n in decode], layout, torch.float16)
    common = dict(num_qo_heads=4, num_kv_heads=pair.cpu.num_kv_heads,
                  head_dim=pair.cpu.head_dim, page_size=4)
    fi = backend_for_windows(FlashInferBackend, WINDOWS, storage=pair.gpu, **common)
    ref = backend_for_windows(ReferenceBackend, WINDOWS, storage=pair.cpu, **common)
    assert isinstance(fi, LayerWindows) and isinstance(ref, LayerWindows)
    for step, (what, reqs) in enumerate((("prefill", requests), ("decode", decode))):
        md = pair.metadata(reqs, 4)
        ref.plan(md)
        fi.plan(md)
        for layer, window_left in enumerate(WINDOWS):
            q, k, v = random_qkv(md.num_tokens, 4, ref.num_kv_heads, ref.head_dim,
                                 torch.float16, seed=30 + 2 * step + layer)
            want = ref.forward_with_lse(layer, q, k, v)
            got = fi.forward_with_lse(layer, q.cuda(), k.cuda(), v.cuda())
            assert got.lse is not None and want.lse is not None
            name = f"{what} layer {layer} (window_left {window_left})"
            measure.close(f"{name} o", got.o, want.o, TOL[torch.float16])
            measure.close(f"{name} lse", got.lse, want.lse, TOL[torch.float16])
        pair.assert_same_storage()
    for member in fi.members:
        assert isinstance(member, FlashInferBackend)
        measure.kernels(member)


@pytest.mark.parametrize("num_qo_heads", DECODE_PATHS)
def test_padded_eager_decode_matches_reference(measure: Measure, num_qo_heads: int) -> None:
    pair = make_pair([c + n for c, n in DECODE], "NHD", torch.bfloat16)
    fi, ref = backends(pair, 16, num_qo_heads=num_qo_heads)
    md = pair.metadata(DECODE, 16, pad_to=7)
    compare_step(measure, pair, md, fi, ref, layer=0, dtype=torch.bfloat16, seed=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_plans_run_the_pinned_kernel_family(measure: Measure, family: KernelFamily) -> None:
    """Explicit families are what the plans resolve to; CUDA-core decode has none."""
    pair = make_pair([c + n for c, n in LONG_PREFILL], "NHD", torch.float16, num_layers=1)
    capability = torch.cuda.get_device_capability()
    if family == "fa3" and capability[0] != 9:
        with pytest.raises(ValueError, match="kernel_family='fa3' needs a Hopper GPU"):
            FlashInferBackend(storage=pair.gpu, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                              kernel_family="fa3")
        return
    decoded = [(c + n, 1) for c, n in LONG_PREFILL]
    for num_qo_heads, decode_family in ((8, family), (4, "cuda-cores")):
        fi, ref = backends(pair, 16, num_qo_heads, family)
        for requests in (LONG_PREFILL, decoded):
            compare_step(measure, pair, pair.metadata(requests, 16), fi, ref, layer=0,
                         dtype=torch.float16, seed=6)
        if family == "auto":  # FlashInfer's pick, which depends on release, GPU and shape
            assert fi.kernels.prefill is not None and fi.kernels.decode is not None
            assert num_qo_heads == 8 or fi.kernels.decode == "cuda-cores"
        else:
            assert fi.kernels == (family, decode_family)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_released_blocks_match_reference(measure: Measure, layout: KvLayout) -> None:
    """Requests whose leading blocks a window released: FlashInfer reads the same pages
    as the reference, appends at kv_positions, and never touches a released block."""
    window_left = 7
    requests = [(21, 100), (37, 65), (40, 30), (150, 1), (97, 1)]
    pair = make_pair([c + n for c, n in requests], layout, torch.float16)
    for slot, (cached, _) in zip(pair.slots, requests, strict=False):
        pair.table.drop_front(slot, max(0, cached - window_left) // BLOCK)
    md = pair.metadata(requests, 8)
    assert md.kv_start is not None and int(md.kv_start.count_nonzero()) == 4
    for num_qo_heads in (4, 8):  # decode rows on CUDA cores, then on tensor cores
        fi, ref = backends(pair, 8, num_qo_heads, window_left=window_left)
        compare_step(measure, pair, md, fi, ref, layer=0, dtype=torch.float16, seed=9,
                     what=f"released h{num_qo_heads}")
        decode = [(c + n, 1) for c, n in requests]
        compare_step(measure, pair, pair.metadata(decode, 8), fi, ref, layer=1,
                     dtype=torch.float16, seed=10, what=f"released decode h{num_qo_heads}")

"""The torch reference backend against dense attention with explicit masks."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.attention.reference import ReferenceBackend
from kvcache.storage.kv_storage import KvLayout
from tests.unit.attention.support import Scenario, causal

# (cached, new) per request: non-page-aligned cached prefixes, empty prefixes, a prefix
# ending exactly on a block boundary, single-token and multi-token chunks side by side.
MIXED = [(0, 7), (5, 6), (13, 1), (16, 9), (3, 1)]
DECODE = [(9, 1), (16, 1), (0, 1), (23, 1), (7, 1)]

CASES = [
    pytest.param(dict(requests=MIXED), {}, id="mixed"),
    pytest.param(dict(requests=DECODE), {}, id="decode"),
    pytest.param(dict(requests=MIXED, num_qo_heads=6, num_kv_heads=2), {}, id="gqa3"),
    pytest.param(dict(requests=DECODE, num_qo_heads=2, num_kv_heads=2), {}, id="mha-decode"),
    pytest.param(dict(requests=MIXED), dict(window_left=4), id="window4"),
    pytest.param(dict(requests=DECODE), dict(window_left=0), id="window0-decode"),
    pytest.param(dict(requests=MIXED, scale=3.0), dict(logits_soft_cap=2.0), id="softcap"),
    pytest.param(dict(requests=MIXED), dict(sm_scale=0.5), id="sm-scale"),
    pytest.param(dict(requests=DECODE, pad_to=8), {}, id="decode-padded"),
]
PAGING = [pytest.param(8, None, id="p8"), pytest.param(8, 4, id="b8p4"),
          pytest.param(8, 2, id="b8p2"), pytest.param(16, 16, id="p16")]
LAYOUTS = [pytest.param("NHD", id="nhd"), pytest.param("HND", id="hnd"),
           pytest.param("BLHNC", id="blhnc")]


def _run(sc: Scenario, options: dict[str, float], layer: int,
         page_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    backend = ReferenceBackend(storage=sc.storage, num_qo_heads=sc.q[0].shape[1],
                               num_kv_heads=sc.storage.num_kv_heads,
                               head_dim=sc.storage.head_dim, page_size=page_size,
                               **options)  # type: ignore[arg-type]
    backend.plan(sc.md)
    out = backend.forward_with_lse(layer, sc.q[layer], sc.k_new[layer], sc.v_new[layer])
    assert out.lse is not None
    return out.o, out.lse


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("block_size", "page_size"), PAGING)
@pytest.mark.parametrize(("shape", "options"), CASES)
def test_reference_matches_dense(shape: dict, options: dict, block_size: int,
                                 page_size: int | None, layout: KvLayout) -> None:
    sc = Scenario(**shape, block_size=block_size, page_size=page_size, layout=layout)
    o, lse = _run(sc, options, layer=1, page_size=page_size)
    want_o, want_lse = sc.expected(1, sm_scale=options.get("sm_scale"),
                                   logits_soft_cap=options.get("logits_soft_cap"),
                                   visible=causal(int(options.get("window_left", -1))))
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_appends_new_tokens_at_their_positions(layout: KvLayout) -> None:
    sc = Scenario(MIXED, block_size=8, page_size=4, layout=layout)
    _run(sc, {}, layer=0, page_size=4)
    for r, (c, n) in enumerate(sc.requests):
        for p in range(c, c + n):
            k, v = sc.read_token(0, r, p)
            assert torch.equal(k, sc.keys[0][r][p]), f"layer 0 request {r} position {p}: k"
            assert torch.equal(v, sc.values[0][r][p]), f"layer 0 request {r} position {p}: v"


def test_padding_requests_output_zeros_and_append_nothing() -> None:
    sc = Scenario(DECODE, pad_to=8)
    before = [pool.clone() for pool in sc.storage.k]
    o, lse = _run(sc, {}, layer=0)
    n = len(DECODE)
    assert torch.equal(o[n:], torch.zeros_like(o[n:]))
    assert bool(torch.isneginf(lse[n:]).all())
    changed = (sc.storage.k[0] != before[0]).flatten(1).any(dim=1).nonzero().flatten().tolist()
    last_blocks = {sc.block_ids[r][(c + m - 1) // 8] for r, (c, m) in enumerate(DECODE)}
    assert set(changed) <= last_blocks, "padding rows wrote into the storage"
    assert torch.equal(sc.storage.k[1], before[1]), "layer 1 changed by a layer 0 forward"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [pytest.param(MIXED, id="mixed"),
                                   pytest.param(DECODE, id="decode")])
def test_repaged_output_equals_direct_paging(shape: list[tuple[int, int]], layout: KvLayout) -> None:
    outs = []
    for page_size in (8, 4, 2, 1):
        sc = Scenario(shape, block_size=8, page_size=page_size, layout=layout, seed=3)
        outs.append(_run(sc, {}, layer=0, page_size=page_size))
    for page_size, (o, lse) in zip((4, 2, 1), outs[1:], strict=True):
        assert torch.equal(o, outs[0][0]), f"page_size {page_size} output differs from 8"
        assert torch.equal(lse, outs[0][1]), f"page_size {page_size} lse differs from 8"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtype", "tol"), [pytest.param(torch.float16, 1e-3, id="fp16"),
                                            pytest.param(torch.bfloat16, 1e-2, id="bf16")])
def test_low_precision_matches_float32_math(dtype: torch.dtype, tol: float,
                                            layout: KvLayout) -> None:
    sc = Scenario(MIXED, block_size=8, page_size=4, layout=layout, dtype=dtype)
    o, lse = _run(sc, {}, layer=0, page_size=4)
    want_o, want_lse = sc.expected(0)
    assert o.dtype == dtype
    torch.testing.assert_close(o.float(), want_o, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_lse_is_base_two() -> None:
    sc = Scenario([(0, 1)], num_qo_heads=2, num_kv_heads=2)
    _, lse = _run(sc, {}, layer=0)
    q, k = sc.q[0][0].float(), sc.keys[0][0][0].float()   # one key: lse = its logit
    logit = (q * k).sum(-1) / math.sqrt(q.shape[-1])
    torch.testing.assert_close(lse[0], logit / math.log(2))


def test_forward_rejects_mismatched_inputs() -> None:
    sc = Scenario(DECODE)
    backend = ReferenceBackend(storage=sc.storage, num_qo_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(RuntimeError, match="before plan"):
        backend.forward(0, sc.q[0], sc.k_new[0], sc.v_new[0])
    backend.plan(sc.md)
    with pytest.raises(ValueError, match="q has shape"):
        backend.forward(0, sc.q[0][:-1], sc.k_new[0], sc.v_new[0])
    with pytest.raises(ValueError, match="dtype"):
        backend.forward(0, sc.q[0], sc.k_new[0].half(), sc.v_new[0])
    with pytest.raises(ValueError, match="layer=2"):
        backend.forward(2, sc.q[0], sc.k_new[0], sc.v_new[0])
    with pytest.raises(ValueError, match="metadata page_size=8"):
        ReferenceBackend(storage=sc.storage, num_qo_heads=4, num_kv_heads=2,
                         head_dim=16, page_size=4).plan(sc.md)


@pytest.mark.parametrize(("kwargs", "match"), [
    pytest.param(dict(num_qo_heads=3), "num_qo_heads=3", id="heads"),
    pytest.param(dict(num_kv_heads=4), "num_kv_heads=4", id="kv-heads"),
    pytest.param(dict(page_size=3), "page_size=3", id="page"),
    pytest.param(dict(window_left=-2), "window_left=-2", id="window"),
    pytest.param(dict(logits_soft_cap=0.0), "logits_soft_cap=0.0", id="softcap"),
])
def test_backend_rejects_bad_options(kwargs: dict, match: str) -> None:
    sc = Scenario([(0, 1)])
    args = dict(storage=sc.storage, num_qo_heads=4, num_kv_heads=2, head_dim=16) | kwargs
    with pytest.raises(ValueError, match=match):
        ReferenceBackend(**args)  # type: ignore[arg-type]



@pytest.mark.parametrize(("field", "request_index", "value", "match"), [
    pytest.param("kv_last_page_len", 1, 4, r"request 1 lists 2 pages of 8 tokens with "
                 r"kv_last_page_len=4, which makes kv_len 12, but kv_lens says 11",
                 id="last-page-long"),
    pytest.param("kv_last_page_len", 0, 0, r"request 0 lists 1 pages of 8 tokens with "
                 r"kv_last_page_len=0", id="last-page-0"),
    pytest.param("kv_last_page_len", 2, 9, r"request 2 lists 2 pages of 8 tokens with "
                 r"kv_last_page_len=9", id="last-page-over"),
    pytest.param("kv_lens", 3, 24, r"request 3 lists 4 pages .* which makes kv_len 25, but "
                 r"kv_lens says 24", id="kv-lens"),
    pytest.param("kv_last_page_len", 5, 1, r"request 5 lists 0 pages of 8 tokens with "
                 r"kv_last_page_len=1", id="padding-with-a-last-page"),
])
def test_plan_derives_kv_len_from_the_pages_as_flashinfer_does(
        field: str, request_index: int, value: int, match: str) -> None:
    """Issue 22: the reference read `kv_lens` and ignored `kv_last_page_len`, which
    FlashInfer reads, so a wrong last-page length failed only a by-hand metadata test.
    It now derives kv_len from the page count and last page, as FlashInfer does, and
    refuses metadata that disagrees with itself at plan, before any layer runs."""
    sc = Scenario(MIXED, pad_to=7)  # 8-token pages; kv_lens 7, 11, 14, 25, 4, then padding
    backend = ReferenceBackend(storage=sc.storage, num_qo_heads=4, num_kv_heads=2, head_dim=16)
    backend.plan(sc.md)  # the builder's own metadata agrees with itself
    bad = getattr(sc.md, field).clone()
    bad[request_index] = value
    with pytest.raises(ValueError, match=r"ReferenceBackend\.plan: " + match):
        backend.plan(sc.md._replace(**{field: bad}))


def test_plan_refuses_a_page_list_longer_than_its_indices() -> None:
    sc = Scenario(MIXED)
    backend = ReferenceBackend(storage=sc.storage, num_qo_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"ReferenceBackend\.plan: kv_indptr lists 10 pages, "
                                         r"but kv_indices holds 9"):
        backend.plan(sc.md._replace(kv_indices=sc.md.kv_indices[:-1]))

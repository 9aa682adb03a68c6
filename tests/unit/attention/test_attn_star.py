"""Star Attention: anchor + local-block context phase, global decode phase."""

from __future__ import annotations

import pytest
import torch

from kvcache.attention.reference import ReferenceBackend
from kvcache.attention.star import StarAttentionBackend
from kvcache.storage.kv_storage import KvLayout
from tests.unit.attention.support import Scenario, Visibility

S = 4  # star block size: small so short prompts span several blocks


def star_visible(i: int, j: int, qo_len: int, kv_len: int) -> bool:
    p = i + kv_len - qo_len
    return j <= p and (j < S or j >= S * (p // S))


def _outputs(sc: Scenario, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(star output, full-attention output) on two copies of the same storage."""
    outs = []
    for cls in (StarAttentionBackend, ReferenceBackend):
        storage = sc.storage
        saved = [pool.clone() for pool in (*storage.k, *storage.v)]
        extra = {"star_block_size": S} if cls is StarAttentionBackend else {}
        backend = cls(storage=storage, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                      page_size=4, **extra)  # type: ignore[arg-type]
        backend.plan(sc.md)
        outs.append(backend.forward(layer, sc.q[layer], sc.k_new[layer], sc.v_new[layer]))
        for pool, old in zip((*storage.k, *storage.v), saved, strict=True):
            pool.copy_(old)
    return outs[0], outs[1]


@pytest.mark.parametrize("layout", [pytest.param("NHD", id="nhd"), pytest.param("HND", id="hnd"),
                                    pytest.param("BLHNC", id="blhnc")])
def test_context_phase_matches_star_mask(layout: KvLayout) -> None:
    # A fresh prompt, a chunk after a non-aligned cached prefix, and a one-token request.
    sc = Scenario([(0, 13), (6, 9), (10, 1)], block_size=8, page_size=4, layout=layout)
    star, _ = _outputs(sc)
    want, _ = sc.expected(0)
    vis: Visibility = star_visible
    want_star, _ = sc.expected(0, visible=vis)
    torch.testing.assert_close(star[:22], want_star[:22], rtol=1e-5, atol=1e-5)
    # The one-token request is phase 2: global attention.
    torch.testing.assert_close(star[22:], want[22:], rtol=1e-5, atol=1e-5)


def test_differs_from_full_attention_only_beyond_the_second_block() -> None:
    sc = Scenario([(0, 13), (6, 9)], block_size=8, page_size=4)
    star, full = _outputs(sc)
    positions = list(range(13)) + list(range(6, 15))
    for row, p in enumerate(positions):
        same = torch.allclose(star[row], full[row], rtol=1e-5, atol=1e-6)
        # Positions < 2S see [0, p] either way (anchor, then their own block).
        assert same == (p < 2 * S), f"row {row} (position {p}): equal={same}"


def test_decode_equals_full_attention() -> None:
    sc = Scenario([(13, 1), (4, 1), (30, 1)], block_size=8, page_size=4, pad_to=4)
    star, full = _outputs(sc)
    assert torch.equal(star, full)


def test_star_declares_no_block_reuse_and_validates_block_size() -> None:
    assert StarAttentionBackend.supports_block_reuse is False
    assert ReferenceBackend.supports_block_reuse is True
    sc = Scenario([(0, 1)])
    with pytest.raises(ValueError, match="star_block_size=0"):
        StarAttentionBackend(storage=sc.storage, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                             star_block_size=0)

"""LayerWindows: each storage layer appends and attends through the backend planned with
its own window, against the dense oracle; and an engine over a model that interleaves
windowed and full-attention layers against the unpaged dense reference."""

from __future__ import annotations

import pytest
import torch

from kvcache import Engine, KvCacheConfig
from kvcache.attention.base import AttentionBackend
from kvcache.attention.layer_windows import LayerWindows, backend_for_windows
from kvcache.attention.reference import ReferenceBackend
from kvcache.attention.star import StarAttentionBackend
from kvcache.model import Transformer, get_preset
from tests.unit.attention.support import Scenario, causal
from tests.unit.dense_model import DenseContext

# (cached, new): a prefill chunk over cached blocks, a fresh prompt, two decodes
REQUESTS = [(21, 5), (0, 9), (30, 1), (13, 1)]
WINDOWS = [4, -1, 4]  # storage layer -> window_left


def _options(sc: Scenario) -> dict[str, object]:
    return {"storage": sc.storage, "num_qo_heads": sc.q[0].shape[1],
            "num_kv_heads": sc.storage.num_kv_heads, "head_dim": sc.storage.head_dim}


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_each_layer_attends_with_its_window(layout: str) -> None:
    sc = Scenario(REQUESTS, num_layers=len(WINDOWS), layout=layout)  # type: ignore[arg-type]
    backend = backend_for_windows(ReferenceBackend, WINDOWS, **_options(sc))
    assert isinstance(backend, LayerWindows)
    assert [m.window_left for m in backend.members] == [4, -1]  # in first-layer order
    assert backend.member(0) is backend.member(2) is not backend.member(1)
    assert backend.window_left == -1  # the widest: a full layer reads every key
    backend.plan(sc.md)
    for layer, window_left in enumerate(WINDOWS):
        out = backend.forward_with_lse(layer, sc.q[layer], sc.k_new[layer], sc.v_new[layer])
        o, lse = sc.expected(layer, visible=causal(window_left))
        torch.testing.assert_close(out.o, o, atol=1e-5, rtol=0)
        assert out.lse is not None
        torch.testing.assert_close(out.lse, lse, atol=1e-5, rtol=0)
        other, _ = sc.expected(layer, visible=causal(4 if window_left < 0 else -1))
        assert not torch.allclose(out.o, other, atol=1e-3), f"layer {layer}: window ignored"
        for r, (cached, new) in enumerate(REQUESTS):  # the new tokens landed in its pages
            for p in range(cached, cached + new):
                k, v = sc.read_token(layer, r, p)
                assert torch.equal(k, sc.keys[layer][r][p])
                assert torch.equal(v, sc.values[layer][r][p])


def test_one_window_builds_a_plain_backend() -> None:
    sc = Scenario(REQUESTS, num_layers=2)
    backend = backend_for_windows(ReferenceBackend, [4, 4], **_options(sc))
    assert type(backend) is ReferenceBackend and backend.window_left == 4


def test_two_finite_windows_take_the_widest_as_their_own() -> None:
    """Released blocks are checked against the composite's window: the widest reaches
    furthest back, so what it accepts every member accepts too."""
    sc = Scenario(REQUESTS, num_layers=2)
    backend = backend_for_windows(ReferenceBackend, [8, 3], **_options(sc))
    assert isinstance(backend, LayerWindows)
    assert backend.window_left == 8 and [m.window_left for m in backend.members] == [8, 3]


def _plain(sc: Scenario, window_left: int, cls: type[ReferenceBackend] = ReferenceBackend,
           **changes: object) -> AttentionBackend:
    return cls(**(_options(sc) | {"window_left": window_left} | changes))  # type: ignore[arg-type]


def test_bad_members_are_refused() -> None:
    sc = Scenario(REQUESTS, num_layers=2)
    full, windowed = _plain(sc, -1), _plain(sc, 4)
    with pytest.raises(ValueError, match="per_layer is empty"):
        LayerWindows([])
    with pytest.raises(ValueError, match="1 layers given, the storage has 2"):
        LayerWindows([full])
    with pytest.raises(ValueError, match=r"two members share window_left \[-1, -1\]"):
        LayerWindows([full, _plain(sc, -1)])
    with pytest.raises(ValueError, match=r"layer 1's backend has sm_scale=0\.5"):
        LayerWindows([full, _plain(sc, 4, sm_scale=0.5)])
    with pytest.raises(ValueError, match="layer 1's backend is StarAttentionBackend"):
        LayerWindows([full, _plain(sc, 4, StarAttentionBackend)])
    other = Scenario(REQUESTS, num_layers=2, seed=1)
    with pytest.raises(ValueError, match="layer 1's backend has storage="):
        LayerWindows([full, _plain(other, 4)])
    with pytest.raises(ValueError, match="'torch' has no CUDA-graph plan layouts"):
        LayerWindows([full, windowed]).graph_layout(1)


def test_forward_before_plan_raises() -> None:
    sc = Scenario(REQUESTS, num_layers=2)
    backend = LayerWindows([_plain(sc, -1), _plain(sc, 4)])
    with pytest.raises(RuntimeError, match=r"LayerWindows\.forward called before plan"):
        backend.forward(0, sc.q[0], sc.k_new[0], sc.v_new[0])


PRESET = "tiny-mixed-swa"


@pytest.mark.parametrize(("chunk", "padded"), [pytest.param(16, False, id="chunked"),
                                               pytest.param(512, False, id="whole"),
                                               pytest.param(16, True, id="chunked-padded")])
def test_engine_over_mixed_layers_equals_the_dense_reference(chunk: int, padded: bool) -> None:
    """Prompts past the 32-token window, prefilled whole or in chunks, then decoded (also
    padded to a batch of 4, as CUDA-graph replay is), warm after cold: every logit equals
    the unpaged reference's, which masks each layer by its own window. The cache keeps
    full-attention bookkeeping, so warm runs reuse blocks outside the window too."""
    config = get_preset(PRESET)
    model = Transformer(config, seed=5).requires_grad_(False)
    engine = Engine(model, KvCacheConfig(tokens_per_block=4, max_num_blocks=128),
                    max_num_tokens=chunk, pad_decode=padded, graph_batch_sizes=(4,))
    assert isinstance(engine.backend, LayerWindows) and engine.attn_backend == "torch"
    assert engine.cache_config.sliding_window is None
    gen = torch.Generator().manual_seed(chunk)
    base = torch.randint(0, config.vocab_size, (70,), generator=gen).tolist()
    prompts = [base, [*base[:61], 7, 8, 9]]
    cold = engine.generate(prompts[:1], 5)
    warm = engine.generate(prompts, 5)
    assert [o.num_cached_tokens for o in warm] == [69, 61]  # all but the last token; shared
    for out in cold + warm:
        ctx = DenseContext(config)
        sequence = [*out.prompt, *out.token_ids]
        dense = ctx.step(model, sequence[:-1])[len(out.prompt) - 1:]
        assert out.logits is not None
        torch.testing.assert_close(out.logits, dense, atol=1e-4, rtol=0)


def test_a_cache_window_is_refused_for_mixed_layers() -> None:
    with pytest.raises(ValueError, match=r"sliding_window=32, but some of the model's layers "
                                         r"attend without a window: their tokens see every"):
        Engine(PRESET, KvCacheConfig(tokens_per_block=4, max_num_blocks=64, sliding_window=32))

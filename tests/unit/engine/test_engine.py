"""Engine: warm equals cold, chunked equals unchunked, batched equals one-by-one, padded
decode equals unpadded, reuse policy per backend and model, preemption, bad input."""

from __future__ import annotations

import logging
import random
from array import array

import numpy as np
import pytest
import torch

from harness.reuse.assertions import predict_from_engine
from kvcache import Engine, KvCacheConfig, ReuseScope
from kvcache.engine import RequestFinishedError
from kvcache.engine.request import Request
from kvcache.engine.step_context import sampled_rows
from kvcache.engine.step_records import Chunk
from kvcache.model import Transformer, get_preset
from kvcache.model.checkpoint import save_pretrained


def prompts(n: int, length: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(1, 500) for _ in range(shared)]
    return [head + [rng.randrange(1, 500) for _ in range(length - shared)] for _ in range(n)]


def cfg(B: int = 16, blocks: int = 256, **kw: object) -> KvCacheConfig:
    return KvCacheConfig(tokens_per_block=B, max_num_blocks=blocks, **kw)  # type: ignore[arg-type]


def assert_same(a, b, atol: float = 1e-5) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.logits, y.logits, atol=atol, rtol=0)


@pytest.mark.parametrize("B", [1, 4, 16])
@pytest.mark.parametrize("length", [16, 17, 23])
def test_warm_equals_cold_with_oracle_reuse(B: int, length: int) -> None:
    engine = Engine("tiny", cfg(B, 512 // B * 4))
    ps = prompts(3, length, seed=length)
    cold = engine.generate(ps, max_new_tokens=4)
    warm = engine.generate(ps, max_new_tokens=4)
    assert_same(cold, warm)
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
    # the last prompt token is never reused; the cold run's tail covers the rest
    assert [o.num_cached_tokens for o in warm] == [length - 1] * 3
    predicted = predict_from_engine(engine)
    assert predicted.totals.reused_blocks == engine.kv_cache_stats().reused_blocks
    for out in warm:
        assert out.kv_metrics is not None
        assert predicted.requests[out.request_id].reused_blocks == \
            out.kv_metrics.num_reused_blocks


def test_chunked_equals_unchunked_and_batched_equals_one_by_one() -> None:
    ps = prompts(4, 37, seed=1, shared=20)
    whole = Engine("tiny", cfg(8), max_num_tokens=512, enable_chunked_prefill=False,
                   max_batch_size=1)
    reference = [whole.generate([p], max_new_tokens=5)[0] for p in ps]
    chunked = Engine("tiny", cfg(8), max_num_tokens=7)  # chunks cut blocks and prefixes
    assert_same(reference, chunked.generate(ps, max_new_tokens=5))
    batched = Engine("tiny", cfg(8), max_num_tokens=512)
    assert_same(reference, batched.generate(ps, max_new_tokens=5))
    predicted = predict_from_engine(chunked)
    assert predicted.totals.reused_blocks == chunked.kv_cache_stats().reused_blocks


def test_padded_decode_equals_unpadded() -> None:
    ps = prompts(3, 12, seed=2)
    plain = Engine("tiny", cfg(4)).generate(ps, max_new_tokens=6)
    padded_engine = Engine("tiny", cfg(4), pad_decode=True, graph_batch_sizes=(4, 8))
    padded = padded_engine.generate(ps, max_new_tokens=6)
    assert_same(plain, padded)


def test_sampled_rows_pick_each_sampling_chunks_last_token() -> None:
    req = Request(0, [1, 2, 3], 1, None, 35, None, True)
    rows = sampled_rows([Chunk(req, 5, False), Chunk(req, 1, True), Chunk(req, 3, True)],
                        torch.device("cpu"))
    assert rows.tolist() == [5, 8] and rows.dtype == torch.long
    # No sampler: still an index (an empty float tensor would not be one). The graph path
    # selects from its padded logits with it, the eager path hands it to the model.
    none = sampled_rows([Chunk(req, 1, False), Chunk(req, 1, False)], torch.device("cpu"))
    assert none.dtype == torch.long and none.shape == (0,)
    assert torch.randn(4, 7).index_select(0, none).shape == (0, 7)


def test_one_token_prefill_chunks_that_sample_nothing() -> None:
    """A 1-token budget cuts prompts into 1-token chunks: decode-shaped steps of a
    graph size (1) in which no row samples, until the prompt's last token."""
    ps = prompts(1, 6, seed=5)
    plain = Engine("tiny", cfg(4)).generate(ps, max_new_tokens=3)
    engine = Engine("tiny", cfg(4), max_num_tokens=1, pad_decode=True, graph_batch_sizes=(1, 2))
    assert_same(plain, engine.generate(ps, max_new_tokens=3))
    assert engine.num_steps == 6 + 2  # five steps sampled nothing


@pytest.mark.parametrize("layout", ["NHD", "HND", "BLHNC"])
@pytest.mark.parametrize("page_size", [2, 4])
def test_repaged_kernel_pages_equal_direct_paging(layout: str, page_size: int) -> None:
    ps = prompts(2, 21, seed=3)
    direct = Engine("tiny", cfg(8), layout=layout)
    cold = direct.generate(ps, max_new_tokens=4)
    repaged = Engine("tiny", cfg(8), layout=layout, page_size=page_size)
    assert_same(cold, repaged.generate(ps, max_new_tokens=4))
    assert_same(cold, repaged.generate(ps, max_new_tokens=4))  # warm, through the copies


def test_star_backend_disables_reuse_with_a_logged_reason(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcache.engine.engine"):
        engine = Engine("tiny", cfg(4, enable_block_reuse=True), attn_backend="star")
    assert "attention backend 'star' does not support block reuse" in caplog.text
    ps = prompts(2, 13)
    engine.generate(ps, max_new_tokens=2)
    engine.generate(ps, max_new_tokens=2)
    assert engine.kv_cache_stats().reused_blocks == 0
    assert engine.reuse_disabled_reason is not None


def test_hybrid_model_reuses_at_snapshots_and_refuses_partial_reuse() -> None:
    engine = Engine("hybrid-tiny", cfg(4))
    assert engine.cache_config.block_reuse and not engine.cache_config.partial_reuse
    assert engine.reuse_disabled_reason is None
    ps = prompts(2, 13)
    cold = engine.generate(ps, max_new_tokens=3)
    warm = engine.generate(ps, max_new_tokens=3)
    assert [o.num_cached_tokens for o in warm] == [12, 12]
    assert [o.token_ids for o in cold] == [o.token_ids for o in warm]
    with pytest.raises(ValueError, match="enable_partial_reuse=True is unsupported for a "
                                         "model with recurrent layers"):
        Engine("hybrid-tiny", cfg(4, enable_partial_reuse=True))


def test_preemption_under_pressure_equals_an_undisturbed_run() -> None:
    ps = prompts(4, 14, seed=4)
    roomy = Engine("tiny", cfg(4, 256)).generate(ps, max_new_tokens=10)
    tight = Engine("tiny", cfg(4, 12))  # 4 requests need 24 blocks at the end
    out = tight.generate(ps, max_new_tokens=10)
    assert_same(roomy, out)
    assert sum(o.num_preemptions for o in out) > 0
    assert tight.manager.leak_report() == []
    tight.manager.check_integrity()


def test_scopes_are_isolated_in_the_engine() -> None:
    ps = prompts(1, 20)
    engine = Engine("tiny", cfg(4))
    engine.generate(ps, max_new_tokens=2, scopes=[ReuseScope(salt=1)])
    other = engine.generate(ps, max_new_tokens=2, scopes=[ReuseScope(salt=2)])
    same = engine.generate(ps, max_new_tokens=2, scopes=[ReuseScope(salt=1)])
    assert (other[0].num_cached_tokens, same[0].num_cached_tokens) == (0, 19)


def test_abort_releases_blocks_and_keeps_committed_ones() -> None:
    engine = Engine("tiny", cfg(4), max_num_tokens=8)
    p = prompts(1, 20)[0]
    rid = engine.add_request(p, 5)
    engine.step()  # one 8-token chunk: 2 full blocks committed
    out = engine.abort(rid)
    assert out.finish_reason.value == "aborted"
    with pytest.raises(RequestFinishedError, match=rf"abort\(#{rid}\): request #{rid} already "
                                                   r"finished or was aborted"):
        engine.abort(rid)
    assert engine.kv_cache_stats().used_num_blocks == 0
    assert engine.manager.probe_reuse(p) == 8


def test_requests_hold_their_tokens_as_the_cache_array() -> None:
    """A request's tokens are the cache's array('I') from add_request on (numpy ids
    included), so each plan of its admission takes them with one copy; they grow with
    what it generates."""
    engine = Engine("tiny", cfg(4), max_num_tokens=8)
    p = prompts(1, 10)[0]
    engine.add_request([np.int64(t) for t in p], 3)
    req = engine.scheduler.waiting[0]
    assert type(req.tokens) is array and req.tokens.typecode == "I"
    assert req.tokens.tolist() == p
    while engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
    assert len(req.generated) == 3 and req.tokens.tolist() == p + req.generated


def test_teacher_forcing_feeds_given_tokens() -> None:
    engine = Engine("tiny", cfg(4))
    p = prompts(1, 9)[0]
    out = engine.generate([p], max_new_tokens=3, force_tokens=[[5, 6, 7]])[0]
    assert out.token_ids == [5, 6, 7]
    assert out.logits is not None and out.logits.shape == (3, get_preset("tiny").vocab_size)


def test_from_pretrained_equals_the_saved_model(tmp_path) -> None:
    model = Transformer(get_preset("tiny"), seed=7)
    save_pretrained(model, tmp_path)
    ps = prompts(2, 10)
    a = Engine(model, cfg(4)).generate(ps, max_new_tokens=3)
    b = Engine.from_pretrained(tmp_path, cfg(4)).generate(ps, max_new_tokens=3)
    assert_same(a, b)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(lambda e: e.add_request([1, 512], 1), "token 1 is 512; tokens must be ints "
                     "in \\[0, 512\\)", id="token-vocab"),
        pytest.param(lambda e: e.add_request([1, -1], 1), "token 1 is -1", id="token-neg"),
        pytest.param(lambda e: e.add_request([1.0], 1), "token 0 is 1.0", id="token-float"),
        pytest.param(lambda e: e.add_request([], 1), "empty prompt", id="empty"),
        pytest.param(lambda e: e.add_request([1], 0), "max_new_tokens must be an int >= 1",
                     id="no-new"),
        pytest.param(lambda e: e.add_request([1] * e.max_model_len, 1), "exceeds the model.s maximum",
                     id="too-long"),
        pytest.param(lambda e: e.add_request([1] * 70, 3), "it can never fit", id="pool"),
        pytest.param(lambda e: e.add_request([1], 1, scope=3), "scope must be None or "
                     "ReuseScope", id="scope"),
        pytest.param(lambda e: e.add_request([1], 2, force_tokens=[1]), "force_tokens has 1",
                     id="forced"),
    ],
)
def test_bad_requests_are_rejected_and_the_engine_stays_usable(call, message) -> None:
    engine = Engine("tiny", cfg(4, 16))
    with pytest.raises(ValueError, match=message):
        call(engine)
    assert engine.generate([[1, 2, 3]], max_new_tokens=2)[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"attn_backend": "nope"}, "unknown attention backend 'nope'; supported: "
                     "flashinfer, star, torch", id="backend"),
        pytest.param({"max_num_tokens": 0}, "max_num_tokens must be an int >= 1", id="budget"),
        pytest.param({"cuda_graph": True, "attn_backend": "flashinfer", "device": "cuda"},
                     "cuda_graph=True needs CUDA", id="graph-no-cuda"),
    ],
)
def test_bad_engine_options(kwargs: dict[str, object], message: str) -> None:
    if kwargs.get("cuda_graph") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=message):
        Engine("tiny", cfg(), **kwargs)  # type: ignore[arg-type]

"""KV-cache events: what the manager reports storing and removing, and their hashes."""

from __future__ import annotations

import io

import pytest

from harness.oracle.kv_index import block_hash as published_hash
from kvcache import KvCacheConfig, KvCacheManager, ReuseScope
from kvcache.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hash,
    chain_hashes,
    little_endian_bytes,
    read_jsonl,
    write_jsonl,
)


@pytest.fixture
def events_manager(make_manager):
    """A factory of 4-token-block managers with KV events on (leak-checked)."""
    def make(blocks: int = 8, **kw: object) -> KvCacheManager:
        cfg = KvCacheConfig(tokens_per_block=4, max_num_blocks=blocks, **kw)
        mgr = KvCacheManager(cfg, kv_events=True)
        make_manager.created.append(mgr)
        return mgr
    return make


def _run(mgr: KvCacheManager, seq_id: str, tokens: list[int], scope=None) -> None:
    mgr.add_sequence(seq_id, tokens, scope)
    mgr.commit(seq_id, len(tokens))
    mgr.free_sequence(seq_id)


def test_the_hash_is_the_published_one() -> None:
    for parent, tokens, scope in [(None, [1, 2, 3, 4], None), (7, [9, 0, 2**32 - 1], ("s", 3)),
                                  (2**64 - 1, [], (b"x", None))]:
        assert block_hash(parent, little_endian_bytes(tokens), scope) == published_hash(
            parent, tokens, scope)


def test_commit_stores_a_chain_and_a_duplicate_stores_nothing(events_manager) -> None:
    mgr = events_manager()
    mgr.add_sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.commit("a", 4)
    mgr.commit("a", 9)
    h = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, None)
    assert mgr.take_kv_events() == [
        BlockStored((h[0],), None, (1, 2, 3, 4), 4, None, None),
        BlockStored((h[1],), h[0], (5, 6, 7, 8), 4, None, None)]
    mgr.add_sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 10])  # reuses both blocks
    mgr.commit("b", 9)
    assert mgr.take_kv_events() == []
    mgr.free_sequence("a")  # its committed tail [9] becomes a partial leaf
    tail = block_hash(h[1], little_endian_bytes([9]), None)
    assert mgr.take_kv_events() == [BlockStored((tail,), h[1], (9,), 4, None, None)]
    mgr.free_sequence("b")  # [10] is not a prefix of the cached [9]: a second leaf
    other = block_hash(h[1], little_endian_bytes([10]), None)
    assert mgr.take_kv_events() == [BlockStored((other,), h[1], (10,), 4, None, None)]
    assert mgr.take_kv_events() == []  # taking empties the queue


def test_scopes_hash_apart_and_eviction_and_claims_remove(events_manager) -> None:
    mgr = events_manager(blocks=3)
    _run(mgr, "a", [1, 2, 3, 4, 5], ReuseScope(salt="t"))
    stored = mgr.take_kv_events()
    full = chain_hashes([1, 2, 3, 4], 4, ("t", None))
    assert [e.block_hashes for e in stored] == [(full[0],), (block_hash(
        full[0], little_endian_bytes([5]), ("t", None)),)]
    assert stored[0].salt == "t" and chain_hashes([1, 2, 3, 4], 4, None) != full
    mgr.add_sequence("b", [1, 2, 3, 4, 5, 6], ReuseScope(salt="t"))  # claims the [5] leaf
    assert mgr.take_kv_events() == [BlockRemoved((stored[1].block_hashes[0],))]
    mgr.add_sequence("c", [7, 7, 7])  # takes the last free block: nothing evicted
    assert mgr.take_kv_events() == []
    mgr.free_sequence("b")  # b computed nothing new: its reused 5 tokens are cached again
    assert [e.block_hashes for e in mgr.take_kv_events()] == [stored[1].block_hashes]
    mgr.free_sequence("c")  # committed nothing: nothing to store
    assert mgr.take_kv_events() == []
    mgr.add_sequence("d", [8] * 12)  # needs all 3 blocks: evicts the leaf, then its parent
    assert mgr.take_kv_events() == [BlockRemoved((stored[1].block_hashes[0], full[0]))]
    mgr.free_sequence("d")


def test_reset_clears_and_refuses_while_live(events_manager) -> None:
    mgr = events_manager()
    _run(mgr, "a", [1, 2, 3, 4, 5])
    mgr.take_kv_events()
    mgr.add_sequence("live", [1, 2])
    before = (mgr.stats(), mgr.state.tree.dump())
    with pytest.raises(ValueError, match="reset_cache: 1 sequences are live"):
        mgr.reset_cache()
    assert (mgr.stats(), mgr.state.tree.dump()) == before
    mgr.free_sequence("live")
    mgr.take_kv_events()
    mgr.reset_cache()
    assert mgr.take_kv_events() == [AllBlocksCleared()]
    assert mgr.probe_reuse([1, 2, 3, 4, 5]) == 0 and mgr.stats().cached_num_blocks == 0
    mgr.check_integrity()


def test_events_off_is_an_error_to_read(make_manager) -> None:
    with pytest.raises(ValueError, match="kv_events=False"):
        make_manager().take_kv_events()


def test_json_lines_round_trip_and_bad_lines_name_the_line() -> None:
    events = [BlockStored((1, 2), None, (1, 2, 3, 4, 5), 4, b"\x00s", 3),
              BlockRemoved((2,), "CPU"), AllBlocksCleared()]
    out = io.StringIO()
    assert write_jsonl(events, out) == 3
    assert list(read_jsonl(out.getvalue().splitlines(), "ev.jsonl")) == events
    for line, message in [("{", r"ev.jsonl:2: not JSON"),
                          ('{"type": "Nope"}', r"ev.jsonl:2: unknown event type 'Nope'"),
                          ('{"type": "BlockRemoved", "x": 1}', r"ev.jsonl:2: bad BlockRemoved"),
                          ("[1]", r"ev.jsonl:2: expected an object")]:
        with pytest.raises(ValueError, match=message):
            list(read_jsonl(["", line], "ev.jsonl"))

"""Folding a replica's KV-cache events reproduces its cache, block for block and medium
for medium (device pool and host tier), and an event-only index predicts its reuse: the
two facts a cache-aware router relies on."""

from __future__ import annotations

import contextlib
import io
from array import array
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.oracle.kv_index import EventIndex, block_hash
from kvcache import KvCacheConfig, KvCacheManager, OutOfBlocksError, ReuseScope
from kvcache.core.kv_events import event_to_dict, read_jsonl, write_jsonl

SCOPES = [None, ReuseScope(salt="t"), ReuseScope(salt=b"\x01", lora_id=2)]


def tree_hashes(mgr: KvCacheManager, host: bool | None = None) -> Counter[int]:
    """The hash of every block in the manager's tree, from the tree itself (only those on
    the host tier, or only those on the device, when `host` says so)."""
    B = mgr.state.config.tokens_per_block
    out: Counter[int] = Counter()
    for scope, node in mgr.state.tree.walk():
        if host is not None and node.host != host:
            continue
        path, up = [], node.parent
        while up is not None and up.parent is not None:
            path.append(up)
            up = up.parent
        prefix = array("I", b"".join(n.key for n in reversed(path))).tolist()
        parent = None
        for i in range(0, len(prefix), B):
            parent = block_hash(parent, prefix[i:i + B], scope)
        own = array("I", node.key).tolist()
        if len(own) < B:
            out[block_hash(parent, own, scope)] += 1
            continue
        for i in range(0, len(own), B):
            parent = block_hash(parent, own[i:i + B], scope)
            out[parent] += 1
    return out


op = st.tuples(st.sampled_from(["admit", "commit", "append", "free"]),
               st.lists(st.integers(1, 3), min_size=1, max_size=11), st.integers(0, 2),
               st.integers(0, 20))
# For the host tier: whole requests (admit, commit, free) over a few shared stems, so
# that blocks are cached, evicted to the host, matched there and dropped
STEMS = [[1, 2, 3, 1, 2, 3, 1, 2], [2, 2, 2, 2, 3, 3], [3, 1, 3, 1, 3]]
stem_prompt = st.builds(lambda stem, cut, tail: stem[:cut] + tail, st.sampled_from(STEMS),
                        st.integers(0, 8), st.lists(st.integers(1, 3), max_size=4)).filter(bool)
tier_op = st.tuples(st.sampled_from(["cycle", "cycle", "cycle", "admit", "commit", "free"]),
                    stem_prompt, st.integers(0, 1), st.integers(0, 20))


def _drive(mgr: KvCacheManager, ops: list[tuple[str, list[int], int, int]],
           index: EventIndex, probes: list[list[int]], exact_probe: bool) -> None:
    live: list[str] = []
    for n, (kind, tokens, scope_i, k) in enumerate(ops):
        if kind == "cycle":
            with contextlib.suppress(OutOfBlocksError):
                mgr.add_sequence(f"s{n}", tokens, SCOPES[scope_i])
                mgr.take_copy_ops()  # applied before the forward pass the commit reports
                mgr.commit(f"s{n}", len(tokens))
                mgr.free_sequence(f"s{n}")
        elif kind == "admit" or not live:
            try:
                mgr.add_sequence(f"s{n}", tokens, SCOPES[scope_i])
                live.append(f"s{n}")
            except OutOfBlocksError:
                pass
        else:
            sid = live[k % len(live)]
            seq = mgr.sequences[sid]
            if kind == "commit":
                mgr.commit(sid, min(seq.num_tokens,
                                    seq.num_committed_tokens + k % 6))
            elif kind == "append":
                with contextlib.suppress(OutOfBlocksError):
                    mgr.append_tokens(sid, tokens[:2])
            else:
                mgr.free_sequence(sid)
                live.remove(sid)
        mgr.take_copy_ops()
        index.extend(event_to_dict(e) for e in mgr.take_kv_events())
        assert index.cached("GPU") == tree_hashes(mgr, host=False), f"after op {n} {kind}"
        assert index.cached("CPU") == tree_hashes(mgr, host=True), f"after op {n} {kind}"
        if exact_probe:
            for p in probes:
                for scope in SCOPES:
                    salt, lora = (scope.salt, scope.lora_id) if scope else (None, None)
                    assert index.probe(p, salt, lora, partial_reuse=mgr.state.config.partial_reuse
                                       ) == mgr.probe_reuse(p, scope), (n, p, scope)
    for sid in live:
        mgr.free_sequence(sid)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, max_size=40), blocks=st.integers(3, 10), B=st.sampled_from([1, 2, 4]),
       partial=st.booleans(), copy=st.booleans())
def test_folding_events_reproduces_the_cache(ops, blocks: int, B: int, partial: bool,
                                             copy: bool) -> None:
    cfg = KvCacheConfig(tokens_per_block=B, max_num_blocks=blocks, enable_block_reuse=True,
                        enable_partial_reuse=partial, copy_on_partial_reuse=copy and partial)
    mgr = KvCacheManager(cfg, kv_events=True)
    _drive(mgr, ops, EventIndex(B), [], exact_probe=False)
    mgr.check_integrity()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, max_size=30), B=st.sampled_from([1, 2, 4]), partial=st.booleans(),
       probes=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=11), min_size=1,
                       max_size=4))
def test_an_event_only_index_predicts_probe_reuse(ops, B: int, partial: bool, probes) -> None:
    # exact where a partial match never depends on who holds a block: copy on (or
    # partial off), and a pool large enough that no partial hit is forgone
    cfg = KvCacheConfig(tokens_per_block=B, max_num_blocks=512, enable_block_reuse=True,
                        enable_partial_reuse=partial, copy_on_partial_reuse=partial)
    mgr = KvCacheManager(cfg, kv_events=True)
    _drive(mgr, ops, EventIndex(B), probes, exact_probe=True)


def test_partial_off_predicts_exactly_under_eviction() -> None:
    cfg = KvCacheConfig(tokens_per_block=2, max_num_blocks=4, enable_partial_reuse=False)
    mgr = KvCacheManager(cfg, kv_events=True)
    index = EventIndex(2)
    for i, prompt in enumerate([[1, 2, 3, 4, 5], [1, 2, 9, 9, 9], [7] * 7, [1, 2, 3, 4, 6]]):
        mgr.add_sequence(i, prompt)
        mgr.commit(i, len(prompt))
        mgr.free_sequence(i)
        index.extend(mgr.take_kv_events())
        for probe in ([1, 2, 3, 4, 5], [1, 2, 9, 9, 1], [7, 7, 7, 7, 7]):
            assert index.probe(probe, partial_reuse=False) == mgr.probe_reuse(probe)
    assert index.cached() == tree_hashes(mgr)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(tier_op, min_size=15, max_size=40), blocks=st.integers(4, 8), B=st.sampled_from([1, 2]),
       partial=st.booleans(), copy=st.booleans(), host=st.sampled_from([2, 6]))
def test_folding_events_reproduces_both_tiers(ops, blocks: int, B: int, partial: bool,
                                              copy: bool, host: int) -> None:
    cfg = KvCacheConfig(tokens_per_block=B, max_num_blocks=blocks, enable_block_reuse=True,
                        enable_partial_reuse=partial, copy_on_partial_reuse=copy and partial,
                        host_cache_blocks=host)
    mgr = KvCacheManager(cfg, kv_events=True)
    _drive(mgr, ops, EventIndex(B), [], exact_probe=False)
    mgr.check_integrity()


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(tier_op, min_size=15, max_size=30), B=st.sampled_from([1, 2]),
       probes=st.lists(stem_prompt, min_size=1, max_size=4))
def test_an_event_only_index_predicts_probe_reuse_across_tiers(ops, B: int, probes) -> None:
    # a small device pool offloading to a host tier that never drops: blocks on either
    # medium are hits, and with partial reuse off nobody's holding decides a match
    cfg = KvCacheConfig(tokens_per_block=B, max_num_blocks=5, enable_block_reuse=True,
                        enable_partial_reuse=False, host_cache_blocks=512)
    mgr = KvCacheManager(cfg, kv_events=True)
    _drive(mgr, ops, EventIndex(B), probes, exact_probe=True)


def test_an_offload_moves_a_block_between_media() -> None:
    cfg = KvCacheConfig(tokens_per_block=2, max_num_blocks=2, enable_partial_reuse=False,
                        host_cache_blocks=4)
    mgr = KvCacheManager(cfg, kv_events=True)
    index = EventIndex(2)
    for i, prompt in enumerate([[1, 2, 3], [4, 5, 6], [1, 2, 3]]):
        mgr.add_sequence(i, prompt)
        mgr.commit(i, 2)
        mgr.free_sequence(i)
        mgr.take_copy_ops()
        index.extend(mgr.take_kv_events())
    # [1, 2] went to the host for [4, 5], came back for the third request, and pushed
    # [4, 5] out: one block on each medium
    (on_device,) = index.cached("GPU")
    (on_host,) = index.cached("CPU")
    assert on_device == block_hash(None, [1, 2], None)
    assert on_host == block_hash(None, [4, 5], None)
    assert index.probe([4, 5, 6], partial_reuse=False) == mgr.probe_reuse([4, 5, 6]) == 2


def test_json_lines_replay_equals_live_folding() -> None:
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=2, max_num_blocks=6), kv_events=True)
    for i, prompt in enumerate([[1, 2, 3, 4, 5], [1, 2, 3, 9], [5] * 11]):
        mgr.add_sequence(i, prompt, ReuseScope(salt=b"\x00"))
        mgr.take_copy_ops()  # applied before the forward pass the commit reports
        mgr.commit(i, len(prompt))
        mgr.free_sequence(i)
    events = mgr.take_kv_events()
    out = io.StringIO()
    write_jsonl(events, out)
    live, replayed = EventIndex(2), EventIndex(2)
    live.extend(events)
    replayed.extend(event_to_dict(e) for e in read_jsonl(out.getvalue().splitlines()))
    assert live.cached() == replayed.cached() == tree_hashes(mgr)
    assert replayed.probe([1, 2, 3, 4, 5, 6], salt=b"\x00") == mgr.probe_reuse(
        [1, 2, 3, 4, 5, 6], ReuseScope(salt=b"\x00"))


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 2, "salt": None, "lora_id": None,
            "medium": "GPU"}


def test_a_blocks_chain_reads_its_tokens_up_its_parents() -> None:
    index = EventIndex(2)
    index.extend([_stored([1, 2], None, [5, 6, 7, 8]), _stored([3], 2, [9, 9]),
                  _stored([4], 1, [0, 0])])
    assert index.chain_tokens(3) == (5, 6, 7, 8, 9, 9)
    assert index.chain_tokens(4) == (5, 6, 0, 0)  # a branch after the first block
    assert index.chain_tokens(99) is None  # never stored
    index.apply({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"})
    assert index.chain_tokens(3) is None  # a block above it left the cache
    # hashes that do not chain their parent: a block can name its own descendant
    looped = EventIndex(2)
    looped.extend([_stored([7], 8, [1, 1]), _stored([8], 7, [1, 1])])
    assert looped.chain_tokens(7) is None

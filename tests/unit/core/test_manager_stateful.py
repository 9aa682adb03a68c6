"""Stateful property test: random add / commit / append / free / probe against the oracles.

The reuse model is `harness.oracle.model`, a deliberately naive model written without any
code from `kvcache`. With a pool too large to evict, every admission and probe must equal
its prediction exactly, claim-or-copy included; with small pools the manager must keep
every invariant, never fail an admission that fits, and leave the cache untouched when one
does not. Every step runs under the provenance and capacity oracles too (`CheckedManager`,
sliding windows included): every reuse reads the reader's own KV, and usedNumBlocks is
what the live sequences need.
A small device pool behind a host tier that never drops loses no full block, so with
partial reuse off it must match the unbounded oracle exactly too.
Before every admission `match_reuse` must change nothing and name exactly the blocks,
tokens and claim, copy or onboard the admission then gets, and agree with `probe_reuse`;
under a sliding window too, whose small pools leave hollow paths in the tree.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.oracle import OracleConfig, ReuseOracle
from harness.oracle.checked_manager import CheckedManager
from kvcache import (
    KvCacheConfig,
    KvCacheManager,
    OutOfBlocksError,
    ReuseMatch,
    ReuseScope,
    SequenceHandle,
)
from kvcache.core.ops import BlockCopy, BlockOnboard

# A few stems so that prompts share prefixes, plus random suffixes over a tiny alphabet so
# that partial matches and sibling candidates are common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5], [7]]
prompts = st.builds(lambda stem, cut, tail: stem[:cut] + tail,
                    st.sampled_from(STEMS), st.integers(0, 9),
                    st.lists(st.integers(1, 4), max_size=6)).filter(bool)
scopes = st.sampled_from([None, ReuseScope(salt=0), ReuseScope(salt=1)])
flags = st.sampled_from([(True, True, True), (True, True, False), (True, False, False),
                         (False, False, False)])


class CacheMachine(RuleBasedStateMachine):
    """Drives one manager and the oracle through the same operations."""

    pool_blocks = 10_000
    host_blocks = 0

    def __init__(self) -> None:
        super().__init__()
        self.mgr: CheckedManager | KvCacheManager
        self.oracle: ReuseOracle
        self.next_id = 0
        self.seen = 0

    @initialize(block=st.sampled_from([1, 2, 3, 4]), policy=flags)
    def setup(self, block: int, policy: tuple[bool, bool, bool],
              window: int | None = None) -> None:
        reuse, partial, copy = policy
        cfg = KvCacheConfig(tokens_per_block=block, max_num_blocks=self.pool_blocks,
                            enable_block_reuse=reuse, enable_partial_reuse=partial,
                            copy_on_partial_reuse=copy,
                            host_cache_blocks=self.host_blocks if reuse else 0,
                            sliding_window=window)
        mgr = KvCacheManager(cfg, record_events=True)
        self.mgr = CheckedManager(mgr)
        self.oracle = ReuseOracle(OracleConfig.from_cache_config(cfg))

    @property
    def exact(self) -> bool:
        lossless = self.host_blocks >= 10_000 and not self.mgr.state.config.partial_reuse
        return self.pool_blocks >= 10_000 or lossless

    def sync(self) -> list[object]:
        """Feed the oracle the events the manager recorded since the last sync.

        Only with an unbounded pool: under eviction a sequence may reuse less than the
        oracle predicts, and its later commits would contradict the oracle's replay."""
        assert self.mgr.state.events is not None
        new = self.mgr.state.events[self.seen:]
        self.seen = len(self.mgr.state.events)
        return [self.oracle.apply(ev.as_dict()) for ev in new] if self.exact else []

    def snapshot(self) -> tuple[object, ...]:
        """Everything a read-only call must leave alone (the dump shows LRU times)."""
        pool = self.mgr.state.pool
        return (self.mgr.stats(), self.mgr.state.tree.dump(), list(pool.free), pool.clock,
                len(pool.heap))

    def check_match(self, match: ReuseMatch, seq: SequenceHandle, queued: int) -> None:
        """`match` (taken just before admitting `seq`, with `queued` ops pending) names
        what the admission reused: its held device blocks by position, its host blocks by
        their onboards, and its partial block by the claim, copy or onboard."""
        nfull, skip = match.num_full_blocks, match.num_skipped_blocks
        onboard = match.num_onboard_blocks
        assert seq.num_cached_tokens == match.num_tokens
        assert seq.num_released_blocks == skip
        device = nfull - skip - onboard
        assert len(match.block_ids) == device + (match.partial in ("claim", "copy"))
        assert list(seq.block_ids[skip:skip + device]) == list(match.block_ids[:device])
        metrics = seq.metrics
        assert metrics.num_full_reused_blocks == nfull
        assert metrics.num_partial_reused_blocks == (match.partial is not None)
        assert metrics.num_onboarded_blocks == onboard + (match.partial == "onboard")
        ops = self.mgr.pending_copy_ops[queued:]
        whole = [op.dst for op in ops
                 if type(op) is BlockOnboard
                 and op.num_tokens == self.mgr.state.config.tokens_per_block]
        assert whole == list(seq.block_ids[nfull - onboard:nfull])
        ntok = match.num_tokens - nfull * self.mgr.state.config.tokens_per_block
        if match.partial == "claim":
            assert seq.block_ids[nfull] == match.block_ids[-1]
        elif match.partial is not None:
            kind = BlockCopy if match.partial == "copy" else BlockOnboard
            (op,) = [op for op in ops if type(op) is kind and op.num_tokens == ntok
                     and op.dst == seq.block_ids[nfull]]
            if kind is BlockCopy:
                assert op.src == match.block_ids[-1]

    @rule(tokens=prompts, scope=scopes)
    def add(self, tokens: list[int], scope: ReuseScope | None) -> None:
        seq_id = self.next_id
        self.next_id += 1
        before = self.snapshot()
        match = self.mgr.match_reuse(tokens, scope)
        assert self.snapshot() == before, "match_reuse changed the cache"
        probed = self.mgr.probe_reuse(tokens, scope)
        queued = len(self.mgr.pending_copy_ops)
        assert match.num_tokens == probed
        try:
            seq = self.mgr.add_sequence(seq_id, tokens, scope=scope)
        except OutOfBlocksError as err:
            assert err.needed > err.available
            assert self.snapshot() == before
            return
        assert seq.num_cached_tokens == probed
        self.check_match(match, seq, queued)
        if self.exact:
            (predicted,) = [p for p in self.sync() if p is not None]
            assert seq.num_cached_tokens == predicted.reused_tokens, self.mgr.state.tree.dump()
            assert seq.metrics.num_full_reused_blocks == predicted.full_reused_blocks

    @rule()
    def take_copies(self) -> None:
        """The engine takes queued copies before its next forward pass (a commit takes
        them too); whatever came in between, frees and evictions included, no reuse may
        read KV that was never written."""
        self.mgr.take_copy_ops()
        self.sync()

    @rule(tokens=prompts, scope=scopes)
    def request(self, tokens: list[int], scope: ReuseScope | None) -> None:
        """A whole request: admitted, its prompt computed, freed (blocks cycle through the
        cache, and through the host tier when there is one)."""
        seq_id = self.next_id
        self.add(tokens, scope)
        if seq_id in self.mgr.sequences:
            self.mgr.commit(seq_id, len(tokens))
            self.mgr.free_sequence(seq_id)
            self.sync()

    @precondition(lambda self: self.mgr.sequences)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.mgr.sequences)))
        seq = self.mgr.sequences[seq_id]
        n = data.draw(st.integers(seq.num_committed_tokens, seq.num_tokens))
        self.mgr.commit(seq_id, n)
        self.sync()

    @precondition(lambda self: self.mgr.sequences)
    @rule(data=st.data(), tokens=st.lists(st.integers(1, 4), min_size=1, max_size=5))
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.mgr.sequences)))
        try:
            self.mgr.append_tokens(seq_id, tokens)
        except OutOfBlocksError:
            return
        self.mgr.take_copy_ops()  # its evictions' offloads, as an engine's next step would
        self.sync()

    @precondition(lambda self: self.mgr.sequences)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.mgr.free_sequence(data.draw(st.sampled_from(sorted(self.mgr.sequences))))
        self.sync()

    @rule(tokens=prompts, scope=scopes)
    def probe(self, tokens: list[int], scope: ReuseScope | None) -> None:
        got = self.mgr.probe_reuse(tokens, scope)
        assert self.mgr.match_reuse(tokens, scope).num_tokens == got
        if self.exact:
            assert got == self.oracle.probe(tokens, scope)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_integrity()
        if not self.mgr.sequences:
            assert self.mgr.stats().used_num_blocks == 0
            assert self.mgr.leak_report() == []


class SmallPoolMachine(CacheMachine):
    """The same operations over a pool of 6 blocks: eviction on most admissions."""

    pool_blocks = 6


class LosslessHostTierMachine(CacheMachine):
    """A pool of 6 blocks behind a host tier that never drops: every eviction of a full
    block offloads it, every hit on the host onboards it."""

    pool_blocks = 6
    host_blocks = 10_000

    @initialize(block=st.sampled_from([1, 2, 3]),
                policy=st.sampled_from([(True, False, False), (True, True, True)]))
    def setup(self, block: int, policy: tuple[bool, bool, bool]) -> None:
        super().setup(block, policy)


class SmallTiersMachine(CacheMachine):
    """6 device blocks and 4 host slots: offloads, onboards and drops on most steps."""

    pool_blocks = 6
    host_blocks = 4


class WindowMachine(CacheMachine):
    """Under a sliding window of 1 to 6 tokens: commits release the blocks outside it."""

    @initialize(block=st.sampled_from([1, 2, 3, 4]), policy=flags, window=st.integers(1, 6))
    def setup(self, block: int, policy: tuple[bool, bool, bool],
              window: int | None = None) -> None:
        super().setup(block, policy, window)


class SmallWindowMachine(WindowMachine):
    """A window over a pool of 8 blocks: evictions leave hollow paths, and a match needs
    only the blocks inside the window of its first new token."""

    pool_blocks = 8


_settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestUnboundedPool = CacheMachine.TestCase
TestUnboundedPool.settings = _settings
TestSmallPool = SmallPoolMachine.TestCase
TestSmallPool.settings = _settings
TestLosslessHostTier = LosslessHostTierMachine.TestCase
TestLosslessHostTier.settings = _settings
TestSmallTiers = SmallTiersMachine.TestCase
TestSmallTiers.settings = _settings
TestWindow = WindowMachine.TestCase
TestWindow.settings = _settings
TestSmallWindow = SmallWindowMachine.TestCase
TestSmallWindow.settings = _settings

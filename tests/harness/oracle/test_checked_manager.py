"""CheckedManager: the real manager forwards unchanged; managers with a bug put back
(subclasses that redo what the cache once did wrong) fail the call that shows it."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from harness.oracle import CapacityError, ProvenanceError
from harness.oracle.checked_manager import CallOracles, CheckedManager, ManagerContractError
from harness.oracle.types import Event
from kvcache import (
    DEFAULT_PRIORITY,
    AdmissionPlan,
    KvCacheConfig,
    KvCacheManager,
    OutOfBlocksError,
    SequenceHandle,
)
from kvcache.core.handle import SequenceRecord


def config(B: int = 4, blocks: int = 4) -> KvCacheConfig:
    return KvCacheConfig(tokens_per_block=B, max_num_blocks=blocks, enable_block_reuse=True)


def issue_example(mgr: CheckedManager) -> None:
    """A cached, B copies 3 of its tokens, C evicts the source, B is freed with its copy
    never taken, D matches what B left."""
    mgr.add_sequence("A", [1, 2, 2, 2, 0])
    mgr.commit("A", 5)
    mgr.free_sequence("A")
    mgr.add_sequence("B", [1, 2, 2, 0, 1])
    mgr.add_sequence("C", [7] * 5)
    mgr.free_sequence("B")
    mgr.add_sequence("D", [1, 2, 2, 9])


def test_the_real_manager_passes_and_is_forwarded() -> None:
    mgr = CheckedManager(KvCacheManager(config(), record_events=True))
    issue_example(mgr)
    assert mgr.sequences["D"].num_cached_tokens == 0  # via __getattr__
    mgr.commit("D", 4)
    mgr.add_sequence("E", [1, 2, 2, 5])  # copies 3 tokens of D's block
    mgr.commit("E", 4)  # takes the queued copy first, as an engine's step does
    assert mgr.pending_copy_ops == [] and mgr.state.events[-2].kind == "copy"
    for sid in ("C", "D", "E"):
        mgr.free_sequence(sid)
    mgr.check_oracles()
    assert mgr.num_operations == 14 and mgr.leak_report() == []  # the take included
    mgr.state.allocation_fault = lambda op, n: True
    assert mgr.manager.state.allocation_fault is mgr.state.allocation_fault


def test_only_a_fresh_manager_can_be_checked() -> None:
    used = KvCacheManager(config())
    used.add_sequence("x", [1, 2])
    with pytest.raises(ValueError, match="must be fresh"):
        CheckedManager(used)


def windowed(cls: type[KvCacheManager] = KvCacheManager, blocks: int = 8,
             reuse: bool = True) -> CheckedManager:
    """`cls` under a window of 5 tokens (window_left 4), 4 tokens a block."""
    return CheckedManager(cls(KvCacheConfig(tokens_per_block=4, max_num_blocks=blocks,
                                            enable_block_reuse=reuse, sliding_window=5),
                              record_events=True))


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_a_windowed_manager_is_checked_chunk_by_chunk(reuse: bool) -> None:
    """A 24-token prompt in a pool of 4 blocks, 4 tokens a chunk: every reserve, commit
    and release is checked, and a commit past the reserved blocks is refused."""
    mgr = windowed(blocks=4, reuse=reuse)
    prompt = list(range(1, 25))
    seq = mgr.admit("a", mgr.plan_admission(prompt, first_chunk=4))
    with pytest.raises(ValueError, match="reserve the rest"):
        mgr.commit("a", 5)
    done = 0
    while done < len(prompt):
        done = mgr.reserve("a", min(len(prompt), done + 4))
        mgr.commit("a", done)
        assert mgr.stats().used_num_blocks <= 3
    assert seq.num_released_blocks == 5  # (24 - 4) // 4: the deepest cached block is 5
    assert not mgr.plan_admission([9] * 24, first_chunk=20).fits  # 5 blocks, 3 there
    mgr.add_sequence("b", [9] * 9)  # 3 blocks: the last 3 free or evictable
    assert mgr.reserve("a", 24) == 24
    mgr.free_sequence("a")
    mgr.free_sequence("b")
    mgr.check_oracles()
    assert mgr.leak_report() == []


class KeepsWhatItReleased(KvCacheManager):
    """Commits without releasing the blocks outside the window."""

    def _slide(self, record: SequenceRecord) -> None:
        pass


class ReservesOneShort(KvCacheManager):
    """Reserves one block fewer than it could."""

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int:
        have = len(self.sequences[seq_id].block_ids)
        need = -(-num_tokens // self.state.config.tokens_per_block) - have
        if need > 1:  # ask for the tokens of one block fewer
            num_tokens = (have + need - 1) * self.state.config.tokens_per_block
        return super().reserve(seq_id, num_tokens)


def test_a_window_that_keeps_blocks_or_reserves_short_is_caught() -> None:
    mgr = windowed(KeepsWhatItReleased)
    mgr.add_sequence("a", list(range(16)))
    with pytest.raises(CapacityError, match=r"after commit\('a', 12\), usedNumBlocks "
                                            r"differs(.|\n)*expected  2 \(1 held"):
        mgr.commit("a", 12)
    mgr = windowed(ReservesOneShort)
    mgr.admit("a", mgr.plan_admission(list(range(16)), first_chunk=1))
    with pytest.raises(ManagerContractError, match=r"reserve\('a', 16\): .* it should have "
                                                   r"added 3 blocks"):
        mgr.reserve("a", 16)


class DropsCopiesWithTheirSequence(KvCacheManager):
    """The cache before the fix: a freed sequence's queued copies were dropped, while
    the tokens they were to write stayed cached as its tail."""

    def free_sequence(self, seq_id: Hashable) -> None:
        self.state.op_queue = [e for e in self.state.op_queue if e[0] != seq_id]
        super().free_sequence(seq_id)


def test_reused_kv_that_was_never_written_is_caught_at_admission() -> None:
    mgr = CheckedManager(DropsCopiesWithTheirSequence(config(), record_events=True),
                         repro="reproduce: pytest 'here'")
    with pytest.raises(ProvenanceError) as err:
        issue_example(mgr)
    text = str(err.value)
    assert "admission of 'D' reuses KV that is not its own: 3 of 3 slots differ" in text
    assert "free_sequence('B'): queued copy of slots [0, 3) from block 1 dropped" in text
    assert "reproduce: pytest 'here'" in text


class AcksTheWholeQueue(KvCacheManager):
    """The engine's step before the fix: the whole queue left the manager when the step
    took it, applied or not."""

    def ack_copy_ops(self, num_applied: int) -> None:
        super().ack_copy_ops(len(self.state.op_queue))


def test_an_ack_that_drops_unapplied_ops_is_caught() -> None:
    mgr = CheckedManager(AcksTheWholeQueue(config(), record_events=True))
    mgr.add_sequence("A", [1, 2, 2, 2, 0])
    mgr.commit("A", 5)
    mgr.add_sequence("B", [1, 2, 2, 0, 1])  # copies 3 slots of A's first block
    assert len(mgr.pending_copy_ops) == 1
    with pytest.raises(ManagerContractError, match=r"ack_copy_ops\(0\): the queue went from "
                                                   r".* to \[\]; only its first 0 ops may "
                                                   r"leave it"):
        mgr.ack_copy_ops(0)


class RefusesEarly(KvCacheManager):
    """Refuses any admission once a block is in use, whatever is free."""

    def admit(self, seq_id: Hashable, plan: AdmissionPlan,
              priority: int = DEFAULT_PRIORITY) -> SequenceHandle:
        if self.stats().used_num_blocks:
            raise OutOfBlocksError(f"admit({seq_id!r})", plan.num_new_blocks, 0, 8)
        return super().admit(seq_id, plan, priority)


def test_a_refusal_with_the_blocks_there_is_caught() -> None:
    mgr = CheckedManager(RefusesEarly(config(blocks=8)))
    mgr.add_sequence("a", [1, 2, 3])
    with pytest.raises(CapacityError, match=r"add_sequence\('b', \[4, 5\]\) was refused "
                                            r"although its blocks are there"):
        mgr.add_sequence("b", [4, 5])


class ChangesOnRefusal(KvCacheManager):
    """Appends, then claims it could not."""

    def append_tokens(self, seq_id: Hashable, tokens: list[int]) -> None:
        super().append_tokens(seq_id, tokens)
        raise OutOfBlocksError(f"append_tokens({seq_id!r})", 1, 0, 4)


def test_a_refused_call_that_changed_the_cache_is_caught() -> None:
    mgr = CheckedManager(ChangesOnRefusal(config()))
    mgr.add_sequence("a", [1, 2, 3])
    with pytest.raises(ManagerContractError, match=r"raised OutOfBlocksError .* and changed "
                                                   r"the cache"):
        mgr.append_tokens("a", [4, 5])


class ForgetsTheVersion(KvCacheManager):
    """Switches a deduplicated block but leaves block_ids_version as it was."""

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        super().commit(seq_id, num_tokens)
        self.state.records[seq_id].block_ids_version = 0


def test_block_ids_that_change_silently_are_caught() -> None:
    mgr = CheckedManager(ForgetsTheVersion(config(2, 8)))
    mgr.add_sequence("x", [1, 1, 2])
    mgr.add_sequence("y", [1, 1, 3])
    mgr.commit("x", 2)
    with pytest.raises(ManagerContractError, match="block_ids_version went from 0 to 0"):
        mgr.commit("y", 2)  # deduplicated against x's [1, 1]


class LogsWrongCounts(KvCacheManager):
    """Logs every commit as committing nothing."""

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        super().commit(seq_id, num_tokens)
        events = self.state.events
        assert events is not None
        events[-1] = events[-1]._replace(num_tokens=0)


def test_a_log_that_disagrees_with_the_api_is_caught() -> None:
    mgr = CheckedManager(LogsWrongCounts(config(), record_events=True))
    mgr.add_sequence("x", [1, 2, 3])
    with pytest.raises(ManagerContractError, match="the manager's event log recorded"):
        mgr.commit("x", 3)


def test_a_windowed_refusal_is_judged_by_the_match_it_reported() -> None:
    """'b' reuses all 12 tokens 'a' committed (a holds block 2 of them; 0 and 1 are
    outside b's window): it needs one new block of the 7 there."""
    mgr = windowed(RefusesEarly)
    mgr.add_sequence("a", list(range(12)))
    mgr.commit("a", 12)
    with pytest.raises(CapacityError, match=r"was refused although its blocks are there"
                                            r"\n  expected  admitted: needs 1, 7 of 8"):
        mgr.add_sequence("b", [*range(12), 5])


# -- CallOracles: what CheckedManager checks after a call, fed by any cache's events ---------

def _cached_then_partial(copy: bool) -> list[Event]:
    """A computes blocks 1, 2 and leaves; B reuses block 1 and 1 token of block 2 into
    its own block 3, with (or without) the copy logged in the same call."""
    events = [Event("admit", "A", tuple(range(8)), 0, None, (1, 2)),
              Event("commit", "A", (), 8), Event("free", "A"),
              Event("admit", "B", (0, 1, 2, 3, 4, 9), 5, None, (1, 3))]
    return events + ([Event("copy", "B", (), 1, None, (2, 3))] if copy else [])


def test_call_oracles_read_an_admission_with_the_moves_logged_after_it() -> None:
    ok = CallOracles(4, 8, block_reuse=True)
    ok.provenance(_cached_then_partial(copy=True), [])
    ok.capacity_after("B's admission", _cached_then_partial(copy=True), 2)
    bad = CallOracles(4, 8, block_reuse=True)
    with pytest.raises(ProvenanceError, match="admission of 'B' reuses KV that is not its own"):
        bad.provenance(_cached_then_partial(copy=False), [])


def test_call_oracles_check_the_cache_count_and_each_sequence() -> None:
    oracles = CallOracles(4, 8, block_reuse=True)
    events = _cached_then_partial(copy=True)
    with pytest.raises(CapacityError, match="usedNumBlocks differs"):
        oracles.capacity_after("B's admission", events, 3)
    again = CallOracles(4, 8, block_reuse=True)
    with pytest.raises(CapacityError, match="sequence 'B'"):
        again.capacity_after("B's admission", events, None, [("B", 3, 0)])


def test_checked_manager_runs_its_checks_through_call_oracles() -> None:
    mgr = CheckedManager(KvCacheManager(config(blocks=8), record_events=True))
    assert mgr.oracles.shadow is mgr.shadow and mgr.oracles.capacity is mgr.capacity
    mgr.add_sequence("A", list(range(8)))
    mgr.commit("A", 8)
    assert mgr.capacity.needed == mgr.manager.stats().used_num_blocks == 2

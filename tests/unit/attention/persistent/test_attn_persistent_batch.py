"""PersistentBatch: equal to a full rebuild over random step sequences (sliding-window
releases at the rows' fronts included), decode steps that touch only per-row counters,
bad input that changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.attention.block_table import BlockTable
from kvcache.attention.metadata import PagedMetadata, build_metadata
from kvcache.attention.persistent import decode_layout, page_rows
from kvcache.attention.persistent.batch import PersistentBatch
from tests.unit.attention.support import assert_same_metadata

BLOCK, SLOTS, WIDTH = 8, 6, 12  # a slot holds up to 96 tokens


class Mirror:
    """A PersistentBatch next to what it should hold, kept by hand: each row's slot and
    kv length, in row order. Every step is checked against build_metadata."""

    def __init__(self, k: int, heads: int, max_padded: int | None = None) -> None:
        self.P = BLOCK // k
        self.m = 1 if k == 1 else k * heads
        self.table = BlockTable(SLOTS, WIDTH)
        self.batch = PersistentBatch(self.table, block_size=BLOCK, page_size=self.P,
                                     page_index_multiplier=self.m, max_padded=max_padded)
        self.rows: list[int] = []
        self.kv: dict[int, int] = {}
        self.steps = 0

    def admit(self, slot: int, cached: int, ids: list[int], start: int = 0) -> None:
        """Admit `slot` with `cached` tokens, its blocks `ids` from block `start` on."""
        self.table.assign(slot, ids, start)
        self.batch.add(slot, cached)
        self.rows.append(slot)
        self.kv[slot] = cached

    def leave(self, slot: int) -> None:
        self.batch.remove(slot)
        self.table.release(slot)
        self.rows.remove(slot)
        del self.kv[slot]

    def releasable(self, slot: int) -> int:
        """Blocks `slot` may release: every block before the one of its next token."""
        return self.kv[slot] // BLOCK - int(self.table.starts[slot])

    def release(self, slot: int, count: int) -> None:
        """A sliding window released `slot`'s first `count` blocks, as the scheduler's row sync does."""
        self.table.drop_front(slot, count)
        self.batch.release_front(slot)

    def step(self, counts: list[int] | None, pad: int, ids: list[int]) -> PagedMetadata:
        """One step (counts None: a decode), the table first extended as the engine does
        (blocks for every new token, drawn from `ids`, which may hold some ahead)."""
        per_row = counts or [1] * len(self.rows)
        for slot, n in zip(self.rows, per_row, strict=True):
            listed = self.kv[slot] - int(self.table.starts[slot]) * BLOCK
            short = -(-(listed + n) // BLOCK) - int(self.table.lengths[slot])
            if short > 0:
                self.table.extend(slot, ids[:short])
        taking = [(s, n) for s, n in zip(self.rows, per_row, strict=True) if n]
        pad_to = len(taking) + pad if pad else None
        md = self.batch.step(counts, pad_to=pad_to)
        want = build_metadata(self.table, [s for s, _ in taking], [self.kv[s] for s, _ in taking],
                              [n for _, n in taking], block_size=BLOCK, page_size=self.P,
                              page_index_multiplier=self.m, pad_to=pad_to)
        assert_same_metadata(md, want, f"step {self.steps}: ")
        for slot, n in taking:
            self.kv[slot] += n
        self.steps += 1
        assert self.batch.slots == self.rows
        return md


ids_st = st.lists(st.integers(0, 999), min_size=WIDTH, max_size=WIDTH)


# How a decode step's page starts are written and rows leave and join: (rows up to
# which scalar code starts pages, rows past which every page is gathered again from the
# table, rows leaving or joining up to which the decode counters are patched).
PATHS = {"scalar": (99, 99, 99), "splice": (0, page_rows.SPLICE_LIMIT, 1),
         "regather": (0, 0, 0), "mixed": (1, 2, 2)}


def _take_path(mp: pytest.MonkeyPatch, path: str) -> None:
    scalar, limit, patch = PATHS[path]
    mp.setattr(decode_layout, "SCALAR_STARTS", scalar)
    mp.setattr(page_rows, "SPLICE_LIMIT", limit)
    mp.setattr(decode_layout, "PATCH_LIMIT", patch)


def _maybe_release(data: st.DataObject, mirror: Mirror) -> None:
    """Perhaps release some leading blocks of one row (none when the draw says so)."""
    slot = data.draw(st.sampled_from(mirror.rows), label="release slot")
    count = data.draw(st.integers(0, min(2, mirror.releasable(slot))), label="release")
    if count:
        mirror.release(slot, count)


@settings(max_examples=120, deadline=None)
@given(data=st.data(), k=st.sampled_from([1, 2, 4]), heads=st.sampled_from([1, 3]),
       path=st.sampled_from(sorted(PATHS)))
def test_random_steps_equal_a_full_rebuild(data: st.DataObject, k: int, heads: int,
                                           path: str) -> None:
    """Admissions (with cached prefixes, some of whose blocks a window released),
    finishes, aborts, preemptions (a leave, then the slot admitted again), leaves and
    joins between two decode steps, chunked prefills, rows that sit out, decode runs
    across page boundaries (pages of 2 to 8 tokens: several rows start one in the same
    step), sliding-window releases at the rows' fronts (between decode steps too),
    padding that changes between steps; every step equals build_metadata over the same
    requests. `path` moves the scalar/splice/regather switches so every path runs."""
    mirror = Mirror(k, heads, max_padded=SLOTS + 2)
    with pytest.MonkeyPatch.context() as mp:
        _take_path(mp, path)
        for _ in range(data.draw(st.integers(1, 14), label="events")):
            free = [s for s in range(SLOTS) if s not in mirror.kv]
            event = data.draw(st.sampled_from(["admit", "leave", "preempt", "decode", "chunks",
                                               "release"]))
            if event == "admit" and free:
                cached = data.draw(st.integers(0, 40))
                start = data.draw(st.integers(0, cached // BLOCK), label="start")
                blocks = -(-cached // BLOCK) - start + data.draw(st.integers(0, 1))
                mirror.admit(data.draw(st.sampled_from(free)), cached,
                             data.draw(ids_st)[:blocks], start)
            elif event == "release" and mirror.rows:
                _maybe_release(data, mirror)
            elif event in ("leave", "preempt") and mirror.rows:
                slot = data.draw(st.sampled_from(mirror.rows))
                mirror.leave(slot)
                if event == "preempt":  # recomputed later from what survived
                    cached = data.draw(st.integers(0, 16))
                    mirror.admit(slot, cached, data.draw(ids_st)[: -(-cached // BLOCK)])
            elif event == "decode" and mirror.rows:
                for _ in range(data.draw(st.integers(1, 2 * BLOCK))):
                    if max(mirror.kv[s] - int(mirror.table.starts[s]) * BLOCK
                           for s in mirror.rows) >= WIDTH * BLOCK - 1:
                        break
                    mirror.step(None, data.draw(st.integers(0, 2)), data.draw(ids_st))
                    if data.draw(st.booleans(), label="release between"):
                        _maybe_release(data, mirror)
            elif event == "chunks" and mirror.rows:
                room = [min(5, (WIDTH + int(mirror.table.starts[s])) * BLOCK - mirror.kv[s])
                        for s in mirror.rows]
                counts = [data.draw(st.integers(0, r)) for r in room]
                if any(counts):
                    mirror.step(counts, data.draw(st.integers(0, 2)), data.draw(ids_st))


def _decode_steps(data: st.DataObject, mirror: Mirror, pad: int) -> PagedMetadata | None:
    """Up to 2 * BLOCK decode steps at padding `pad` (fewer where a row would outgrow
    its slot); the last step's metadata (None if none ran)."""
    md = None
    for _ in range(data.draw(st.integers(1, 2 * BLOCK), label="steps")):
        if max(mirror.kv[s] - int(mirror.table.starts[s]) * BLOCK
               for s in mirror.rows) >= WIDTH * BLOCK - 1:
            break
        md = mirror.step(None, pad, data.draw(ids_st))
    return md


@settings(max_examples=80, deadline=None)
@given(data=st.data(), k=st.sampled_from([1, 2]), path=st.sampled_from(sorted(PATHS)))
def test_leaves_and_joins_between_decode_steps(data: st.DataObject, k: int,
                                               path: str) -> None:
    """A serving steady state: between runs of decode steps at one padding, requests
    finish and others join (some with a prefix whose leading blocks a window released),
    or are preempted and come back, all leaves first or each followed by a join. Every
    step equals build_metadata; when as many rows joined as left (no more than
    PATCH_LIMIT), the step after keeps the metadata object (its counters patched, not
    laid out again)."""
    mirror = Mirror(k, heads=1, max_padded=SLOTS + 2)
    pad = data.draw(st.integers(0, 2), label="pad")
    with pytest.MonkeyPatch.context() as mp:
        _take_path(mp, path)

        def admit(slot: int) -> None:
            cached = data.draw(st.integers(0, 40), label="cached")
            released = data.draw(st.sampled_from([False, False, False, True]), label="window")
            start = data.draw(st.integers(0, cached // BLOCK), label="start") if released else 0
            mirror.admit(slot, cached, data.draw(ids_st)[: -(-cached // BLOCK) - start], start)

        for slot in range(data.draw(st.integers(1, SLOTS), label="rows")):
            admit(slot)
        md = _decode_steps(data, mirror, pad)
        for _ in range(data.draw(st.integers(1, 6), label="rounds")):
            before = len(mirror.rows)
            leaving = data.draw(st.lists(st.sampled_from(mirror.rows), unique=True,
                                         max_size=3), label="leaving")
            free = [s for s in range(SLOTS) if s not in mirror.kv or s in leaving]
            joining = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=3,
                                         min_size=0 if len(mirror.rows) > len(leaving) else 1)
                                if free else st.just([]), label="joining")
            # Interleaved, each leave is followed by a join (rows compacted each time).
            interleaved = data.draw(st.booleans(), label="interleaved")
            joins = len(joining)
            for slot in leaving:
                mirror.leave(slot)
                if interleaved and joining and joining[0] not in mirror.kv:
                    admit(joining.pop(0))
            for slot in joining:
                admit(slot)
            last = md
            md = _decode_steps(data, mirror, pad)
            patched = len(leaving) <= decode_layout.PATCH_LIMIT and joins <= (
                decode_layout.PATCH_LIMIT)
            if (md is not None and last is not None and len(mirror.rows) == before
                    and patched and (md.kv_start is None) == (last.kv_start is None)):
                assert md is last, "the layout was patched, not laid out again"


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("pad", [0, 2])
def test_phase_plans_survive_leaves_and_joins(monkeypatch: pytest.MonkeyPatch, path: str,
                                              pad: int) -> None:
    """Five rows at four phases decode a page cycle (each phase planned); two leave and
    two join, interleaved (rows compacted twice before the next step), one at a leaver's
    phase and one at a phase none had. The next two page cycles equal
    build_metadata; where PATCH_LIMIT lets them, on the same metadata object, and the
    plans made before are the ones used after, patched: none is made again."""
    _take_path(monkeypatch, path)
    mirror = Mirror(1, heads=1, max_padded=SLOTS + 2)
    rng = np.random.default_rng(1)
    for slot, cached in enumerate((3, 10, 17, 28, 36)):
        mirror.admit(slot, cached, rng.integers(0, 999, WIDTH).tolist())
    for _ in range(BLOCK):
        md = mirror.step(None, pad, rng.integers(0, 999, WIDTH).tolist())
    plans = list(mirror.batch._decode._starts)
    assert sum(plan is not None for plan in plans) == 4  # rows 3 and 4 share one
    mirror.leave(1)
    mirror.admit(1, 26, rng.integers(0, 999, WIDTH).tolist())  # row 1's phase, last row
    mirror.leave(3)
    mirror.admit(5, 13, rng.integers(0, 999, WIDTH).tolist())  # a phase no row had
    patched = decode_layout.PATCH_LIMIT >= 2  # else two joiners lay every row out again
    for _ in range(2 * BLOCK):
        step = mirror.step(None, pad, rng.integers(0, 999, WIDTH).tolist())
        assert step is md or not patched
    for before, after in zip(plans, mirror.batch._decode._starts, strict=True):
        assert before is None or after is before or not patched, "plans were made again"


CHURN_ORDERS = ("leaves first", "joins first", "interleaved")


def _join(mirror: Mirror, rng: np.random.Generator, slot: int) -> None:
    """Admit `slot` with a random context of up to 40 tokens and random block ids."""
    cached = int(rng.integers(0, 40))
    mirror.admit(slot, cached, rng.integers(0, 999, -(-cached // BLOCK)).tolist())


@pytest.mark.parametrize("order", CHURN_ORDERS)
@pytest.mark.parametrize("pad", [0, 1, 2])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_small_churn_around_the_padding(monkeypatch: pytest.MonkeyPatch, path: str,
                                              pad: int, order: str) -> None:
    """Every churn of up to three leaves and three joins between page cycles of 1-4
    decoding rows, in each order, at each padding: joins first take the rows past the
    last layout's padding before any leave (where the kept counters once broke), leaves
    first shrink it. Rows sit at distinct phases so the cycle before made several plans;
    the leavers are taken from the front, the back and the middle. The two page cycles
    after each churn equal build_metadata at every step (Mirror checks it)."""
    _take_path(monkeypatch, path)
    rng = np.random.default_rng(7)
    for rows in range(1, 5):
        for leaves in range(min(3, rows) + 1):
            for joins in range(4):
                if not 0 < rows - leaves + joins <= SLOTS or rows + joins > SLOTS:
                    continue
                mirror = Mirror(1, heads=1, max_padded=SLOTS + 2)
                for slot in range(rows):
                    cached = 3 + 9 * slot  # phases 3, 4, 5, 6 of the 8-token cycle
                    mirror.admit(slot, cached, rng.integers(0, 999, WIDTH).tolist())
                for _ in range(BLOCK):
                    mirror.step(None, pad, rng.integers(0, 999, WIDTH).tolist())
                leaving = [mirror.rows[i] for i in (0, -1, len(mirror.rows) // 2)][:leaves]
                leaving = list(dict.fromkeys(leaving))
                leaving += [s for s in mirror.rows if s not in leaving][:leaves - len(leaving)]
                joining = list(range(rows, rows + joins))
                if order == "joins first":
                    for slot in joining:
                        _join(mirror, rng, slot)
                for i, slot in enumerate(leaving):
                    mirror.leave(slot)
                    if order == "interleaved" and i < len(joining):
                        _join(mirror, rng, joining[i])
                if order == "leaves first":
                    for slot in joining:
                        _join(mirror, rng, slot)
                elif order == "interleaved":
                    for slot in joining[len(leaving):]:
                        _join(mirror, rng, slot)
                for _ in range(2 * BLOCK):
                    mirror.step(None, pad, rng.integers(0, 999, WIDTH).tolist())


@pytest.mark.parametrize("path", sorted(PATHS))
def test_rows_joining_past_the_padding_then_one_leaving(monkeypatch: pytest.MonkeyPatch,
                                                        path: str) -> None:
    """Two rows decode; three join and one leaves before the next step. The joiners'
    kv_indptr entries run past the last layout's rows into the int32 buffer where its
    counters were kept: the leave must not move those counters (that is, kv_indptr)."""
    _take_path(monkeypatch, path)
    mirror = Mirror(1, heads=1, max_padded=SLOTS + 2)
    mirror.admit(0, 0, [])
    mirror.admit(1, 0, [])
    mirror.step(None, 0, [5] * WIDTH)
    mirror.admit(2, 0, [])
    mirror.admit(3, 0, [])
    mirror.admit(4, 1, [6])
    mirror.leave(0)
    for _ in range(BLOCK + 1):
        mirror.step(None, 0, [7] * WIDTH)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_leave_renumbers_the_rows_of_every_plan(monkeypatch: pytest.MonkeyPatch,
                                                  path: str) -> None:
    """Pages of 4 tokens; six rows, two of which start pages at one phase, decode past
    a page cycle; row 1 leaves and a row joins: every plan's rows after row 1 move down,
    the plans without row 1 too (those whose rows the gather path reads)."""
    _take_path(monkeypatch, path)
    mirror = Mirror(2, heads=1, max_padded=SLOTS + 2)
    for slot, cached in enumerate((2, 0, 0, 0, 2)):
        mirror.admit(slot, cached, [0] * -(-cached // BLOCK))
    for _ in range(8):
        mirror.step(None, 0, [0] * WIDTH)
    mirror.admit(5, 0, [])
    for _ in range(6):
        mirror.step(None, 0, [0] * WIDTH)
    mirror.leave(1)
    mirror.admit(1, 1, [0])
    for _ in range(BLOCK):
        mirror.step(None, 0, [0] * WIDTH)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_release_after_a_leave_then_another_leave(monkeypatch: pytest.MonkeyPatch,
                                                    path: str) -> None:
    """A row leaves (its blocks released), another releases its first block and then
    leaves too: the cut, before the second leave, must not read the first's slot."""
    _take_path(monkeypatch, path)
    mirror = _decoding()
    mirror.step(None, 0, [])
    mirror.leave(0)
    mirror.release(1, 1)
    mirror.leave(1)
    for _ in range(BLOCK):
        mirror.step(None, 0, list(range(WIDTH)))


def _decoding(k: int = 1, contexts: tuple[int, ...] = (9, 20, 30)) -> Mirror:
    mirror = Mirror(k, heads=1)
    rng = np.random.default_rng(0)
    for slot, c in enumerate(contexts):
        mirror.admit(slot, c, rng.integers(0, 999, WIDTH).tolist())
    return mirror


@pytest.mark.parametrize("path", sorted(PATHS))
def test_decode_without_a_new_page_only_bumps_counters(monkeypatch: pytest.MonkeyPatch,
                                                       path: str) -> None:
    """Contexts 9, 20, 30, page 8. The first decode writes positions 9, 20, 30; the second,
    10, 21, 31, all in pages the rows hold; the third starts row 2's fifth page."""
    _take_path(monkeypatch, path)
    mirror = _decoding()
    first = mirror.step(None, 0, [])
    pages = first.kv_indices.data_ptr()
    second = mirror.step(None, 0, [])
    assert second is first, "a quiet decode step returns the same metadata object"
    assert second.kv_indices.data_ptr() == pages, "and moves no page"
    assert second.positions.tolist() == [10, 21, 31]
    third = mirror.step(None, 0, [])  # row 2 starts page 4: one page spliced in
    assert third.kv_indptr.tolist() == [0, 2, 5, 10]
    assert third.kv_last_page_len.tolist() == [4, 7, 1]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("k", [1, 2])
def test_rows_that_start_pages_together(monkeypatch: pytest.MonkeyPatch, path: str,
                                        k: int) -> None:
    """Contexts 8, 16, 24 (and 5): three rows start a page at the same steps."""
    _take_path(monkeypatch, path)
    mirror = _decoding(k, contexts=(8, 5, 16, 24))
    for _ in range(2 * BLOCK + 1):
        mirror.step(None, 0, [])


@pytest.mark.parametrize("counts", [
    pytest.param([2, 1, 0], id="last-sits-out"),
    pytest.param([0, 3, 1], id="first-sits-out"),
    pytest.param([5, 0, 0], id="one-takes-part"),
    pytest.param([0, 1, 1], id="decode-subset"),
])
def test_rows_that_sit_out_are_left_out(counts: list[int]) -> None:
    mirror = _decoding()
    mirror.step(None, 0, [])
    md = mirror.step(counts, 1, [])
    assert md.num_requests == sum(1 for c in counts if c)
    mirror.step(None, 0, [])  # and the decode layout comes back


def test_padding_rows_stay_empty_across_decode_steps() -> None:
    mirror = _decoding()
    for _ in range(2 * BLOCK):  # every row crosses pages, padding must not move
        md = mirror.step(None, 2, [int(i) for i in range(WIDTH)])
    assert md.kv_lens.tolist()[3:] == [0, 0] and md.positions.tolist()[3:] == [0, 0]


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_row_without_its_next_block_is_refused_and_nothing_changes(
        monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    _take_path(monkeypatch, path)
    mirror = _decoding(contexts=(15,))  # position 15 fills block 1; position 16 needs block 2
    mirror.table.assign(0, mirror.table.block_ids(0)[:2])
    mirror.step(None, 0, [])
    with pytest.raises(ValueError, match="slot 0 holds 2 blocks, but its page 2 is in block 2"):
        mirror.batch.step()
    mirror.step(None, 0, [77])  # the block arrives: the step goes through as if never refused
    assert mirror.batch.kv_len(0) == 17


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_chunk_past_the_blocks_is_refused_and_nothing_changes(
        monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    _take_path(monkeypatch, path)
    mirror = _decoding(contexts=(15, 3))
    mirror.table.assign(0, mirror.table.block_ids(0)[:2])  # room for 16 tokens
    mirror.step(None, 0, [])
    with pytest.raises(ValueError, match="slot 0 holds 2 blocks"):
        mirror.batch.step([2, 1])
    mirror.step([2, 1], 0, [41, 42])


def test_a_page_id_past_int32_is_refused() -> None:
    table = BlockTable(1, 2)
    table.assign(0, [1, 2])
    batch = PersistentBatch(table, block_size=BLOCK, page_size=4, page_index_multiplier=2**30)
    with pytest.raises(ValueError, match="page id 2147483648 overflows int32"):
        batch.add(0, 9)  # block 2's first page: 2 * 2**30
    assert len(batch) == 0


@pytest.mark.parametrize(("call", "match"), [
    pytest.param(lambda b: b.add(SLOTS, 0), f"slot {SLOTS} is outside", id="add-slot-high"),
    pytest.param(lambda b: b.add(-1, 0), "slot -1 is outside", id="add-slot-negative"),
    pytest.param(lambda b: b.add(0, 0), "slot 0 .* has a row already", id="add-twice"),
    pytest.param(lambda b: b.add(4, -1), "num_cached=-1", id="add-negative"),
    pytest.param(lambda b: b.add(4, 9), "slot 4 holds 0 blocks", id="add-without-blocks"),
    pytest.param(lambda b: b.remove(4), r"slot 4 has no row \(rows: \[0, 1, 2\]\)", id="remove"),
    pytest.param(lambda b: b.kv_len(5), "slot 5 has no row", id="kv-len"),
    pytest.param(lambda b: b.rewrite(5), "slot 5 has no row", id="rewrite"),
    pytest.param(lambda b: b.release_front(5), "slot 5 has no row", id="release-front"),
    pytest.param(lambda b: b.step([1, 1]), r"one int per row \(3\)", id="counts-length"),
    pytest.param(lambda b: b.step([1.0, 1.0, 1.0]), "dtype float64", id="counts-float"),
    pytest.param(lambda b: b.step([1, -1, 1]), r"num_new=\[1, -1, 1\]", id="counts-negative"),
    pytest.param(lambda b: b.step([0, 0, 0]), "at least one row", id="counts-zero"),
    pytest.param(lambda b: b.step(pad_to=2), "pad_to=2 is outside", id="pad-small"),
    pytest.param(lambda b: b.step([2, 0, 0], pad_to=SLOTS + 1), "pad_to=7", id="pad-large"),
])
def test_bad_input_changes_nothing(call, match: str) -> None:  # type: ignore[no-untyped-def]
    mirror = _decoding()
    mirror.step([3, 1, 2], 0, [5, 6])
    with pytest.raises(ValueError, match=match):
        call(mirror.batch)
    for _ in range(BLOCK + 1):
        mirror.step(None, 0, [5, 6])  # the batch carries on exactly as the mirror says


@pytest.mark.parametrize("k", [1, 2])
def test_rewrite_rereads_a_row_whose_blocks_were_switched(k: int) -> None:
    """A commit deduplicated against an equal cached block switches blocks of a live row
    in the table; after `rewrite` every step equals the rebuild again, decode layout
    included (without it the kept pages would still name the blocks given back)."""
    mirror = _decoding(k)
    mirror.step(None, 0, [])  # a decode layout is kept
    mirror.table.assign(1, [900, 901, *mirror.table.block_ids(1)[2:]])
    mirror.batch.rewrite(1)
    for counts in (None, None, [2, 1, 0], None):
        mirror.step(counts, 0, [5, 6])


@pytest.mark.parametrize("k", [1, 2])
def test_rewrite_rereads_the_page_a_row_appends_to(k: int) -> None:
    """Any block of a row may be replaced by one holding the same KV, the one its next
    token goes to included: after `rewrite` the kept decode layout is dropped, so the
    next decode appends into the new block's page, not into the one given back."""
    mirror = _decoding(k)
    mirror.step(None, 0, [])  # a decode layout is kept; row 1 appends into block 2
    mirror.table.assign(1, [900, 901, 902, *mirror.table.block_ids(1)[3:]])
    mirror.batch.rewrite(1)
    for counts in (None, None, [2, 1, 0], None):
        mirror.step(counts, 0, [5, 6])


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("k", [1, 2])
def test_release_front_keeps_the_decode_layout(monkeypatch: pytest.MonkeyPatch, path: str,
                                               k: int) -> None:
    """Contexts 20, 30, 9: row 1 releases 2 blocks between decode steps. Its pages leave
    kv_indices, the rows after it move down, kv_start shows position 16, and the next
    quiet steps return that metadata object again."""
    _take_path(monkeypatch, path)
    mirror = _decoding(k, contexts=(20, 30, 9))
    first = mirror.step(None, 0, [])
    assert first.kv_start is None
    before = first.kv_indptr.tolist()
    mirror.release(1, 2)
    second = mirror.step(None, 0, [])  # positions 21, 31, 10: no row starts a page
    assert second.kv_start is not None and second.kv_start.tolist() == [0, 16, 0]
    assert second.kv_lens.tolist() == [22, 16, 11]
    assert second.kv_indptr.tolist() == [before[0], before[1], before[2] - 2 * k,
                                         before[3] - 2 * k]
    assert mirror.step(None, 0, []) is second
    for _ in range(2 * BLOCK):  # across page starts, and a second release
        mirror.step(None, 0, [3, 4])
        if mirror.steps == BLOCK:
            mirror.release(0, 1)


def test_release_front_past_the_row_is_refused() -> None:
    """A table whose start moved past the row's tokens, or back, is refused; the batch
    goes on once the table is right again."""
    mirror = _decoding(contexts=(20, 9))
    mirror.step(None, 0, [])
    ids = mirror.table.block_ids(0)
    mirror.table.drop_front(0, 3)  # position 24, past the row's 21 tokens
    with pytest.raises(ValueError, match="slot 0's blocks start at position 24, but its row "
                                         "starts at 0 and holds 21 tokens"):
        mirror.batch.release_front(0)
    mirror.table.assign(0, ids[1:], 1)
    mirror.batch.release_front(0)
    mirror.table.assign(0, ids)  # back to position 0
    with pytest.raises(ValueError, match="start at position 0, but its row starts at 8"):
        mirror.batch.rewrite(0)
    mirror.table.assign(0, ids[1:], 1)
    for _ in range(BLOCK):
        mirror.step(None, 0, [])


def test_add_before_the_slots_start_is_refused() -> None:
    mirror = _decoding(contexts=(20,))
    mirror.table.assign(4, [1, 2], 2)
    with pytest.raises(ValueError, match="num_cached=9 is negative or before position 16"):
        mirror.batch.add(4, 9)
    mirror.admit(4, 17, [1, 2], 2)
    mirror.step([3, 2], 1, [])
    mirror.step(None, 1, [5, 6])


def test_rewrite_follows_a_release_in_the_same_commit() -> None:
    """A deduplicated commit may release leading blocks too: rewrite takes both."""
    mirror = _decoding(contexts=(20, 30))
    mirror.step(None, 0, [])
    mirror.table.assign(1, [900, *mirror.table.block_ids(1)[2:]], 1)
    mirror.batch.rewrite(1)
    for counts in (None, [2, 1], None):
        mirror.step(counts, 0, [5, 6])


def test_reset_recounts_the_rows() -> None:
    """A caller whose step failed recounts the rows: the batch then follows them again."""
    mirror = _decoding(contexts=(15, 20))
    before = dict(mirror.kv)
    mirror.batch.step([2, 1])  # handed out, never run
    mirror.batch.reset([(0, before[0]), (1, before[1])])
    assert mirror.batch.kv_len(0) == 15 and mirror.batch.slots == [0, 1]
    for counts in ([2, 1], None, None, [0, 3]):
        mirror.step(counts, 0, [])


def test_an_empty_batch_has_no_step() -> None:
    mirror = _decoding(contexts=(3,))
    mirror.leave(0)
    assert len(mirror.batch) == 0
    with pytest.raises(ValueError, match="the batch has no rows"):
        mirror.batch.step()


def test_bad_paging_is_refused() -> None:
    with pytest.raises(ValueError, match="PersistentBatch: page_size=3"):
        PersistentBatch(BlockTable(1, 1), block_size=BLOCK, page_size=3)


def test_a_multiplier_without_repaging_leaves_the_ids_alone() -> None:
    """With a page per block the ids are the block ids, whatever multiplier is given (as
    build_metadata's): page starts in decode steps included."""
    table = BlockTable(2, WIDTH)
    table.assign(0, list(range(10, 10 + WIDTH)))
    batch = PersistentBatch(table, block_size=BLOCK, page_index_multiplier=4)
    batch.add(0, 7)
    for kv in range(7, 7 + 2 * BLOCK):
        md = batch.step()
        want = build_metadata(table, [0], [kv], [1], block_size=BLOCK)
        assert_same_metadata(md, want, f"kv {kv}: ")

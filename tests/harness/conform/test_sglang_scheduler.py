"""SGLang's own scheduler code behind the protocol, on the newest SGLang release and on
one release of each form of its code before `checkpoint_kv_cache` (`sglang_legacy`):
0.5.21 (`ReqKvInfo` holds the row, the tree's `insert_req`), 0.5.18 (the row on the
Req), 0.5.16 (no `cache_salt`, the server's own publish shim), 0.5.14 (`fill_len`) and
0.5.10 (`fill_ids` lists, `release_req` a batch method, no `maybe_cache_unfinished_req`)
and 0.5.8 (a chunked request's row freed after each middle chunk, no `alloc_extend_naive`,
positional tree calls; finding 20), each where its cached install exists (skipped otherwise, as the engine smoke is): what
its retraction, its checkpoints, the chunks PrefillAdder cuts, its admission reserve and
its eviction do, op by op, judged by every oracle, and the caller extra key reaching a
LoRA's KV (sgl-project/sglang#24638). One worker per release serves the session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from harness.conform import ops
from harness.conform.controller import install
from harness.conform.controller.checks import check_named
from harness.conform.controller.engine_spec import EngineSpec, open_target
from harness.conform.controller.judge import Judge
from harness.conform.controller.locks import find_lock, pinned
from harness.conform.controller.report import Report
from harness.conform.controller.runner import check_all
from harness.conform.controller.targets import Target
from harness.conform.ops import Op
from harness.conform.protocol import CacheOptions, Scope, lora_id_text
from harness.conform.versions import parse_version
from harness.conform.worker.session import StepReport

B = 4
LOCKS = [next(lock for lock in pinned() if lock.engine == "sglang"),
         *(find_lock("sglang", v) for v in ("0.5.21", "0.5.18", "0.5.16", "0.5.14", "0.5.10",
                                           "0.5.8"))]
SALTED = "0.5.18"  # the first release whose Req has a cache_salt beside its extra key
PROMPT = list(range(100, 110))  # 10 tokens: 2 whole pages
OUT = [900, 901, 902]


@pytest.fixture(scope="session", params=LOCKS, ids=[lock.spec for lock in LOCKS])
def target(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    lock = request.param
    if install.installed(lock) is None:
        pytest.skip(f"{lock.spec} is not installed in {install.cache_dir()} (kvharness "
                    f"conform {lock.spec} installs it)")
    folder = tmp_path_factory.mktemp("sglang")
    opened = open_target(EngineSpec.parse(lock.spec), Report(lock.spec), folder,
                         lambda _: None)
    yield opened
    opened.close()


def judged(target: Target, op_list: list[Op], num_blocks: int = 16,
           options: CacheOptions | None = None) -> tuple[list[StepReport], list[Any]]:
    """`op_list` on a fresh cache (opened with `options`): the reports and what every
    oracle found."""
    judge = Judge(target.open(num_blocks, B, options), num_blocks)
    reports = target.apply_all(op_list)
    return reports, [v for r in reports for v in judge.observe(r)]


def run(target: Target, op_list: list[Op], num_blocks: int = 16,
        options: CacheOptions | None = None) -> list[StepReport]:
    """`op_list` on a fresh cache (opened with `options`), every oracle silent."""
    reports, found = judged(target, op_list, num_blocks, options)
    assert found == [], found
    return reports


def decoded(seq: str) -> list[Op]:
    """`seq` computes PROMPT and decodes OUT, one step at a time."""
    out = [ops.admit(seq, PROMPT), ops.commit(seq, len(PROMPT))]
    for i, token in enumerate(OUT):
        out += [ops.append(seq, [token]), ops.commit(seq, len(PROMPT) + i + 1)]
    return out


def test_the_contract_says_what_sglangs_scheduler_code_does(target: Target) -> None:
    c = target.open(8, B)
    # PrefillAdder keeps a page beyond the prompt from 0.5.12, compares strictly always
    assert (c.matchable_at, c.preemption, c.chunking, c.admission_fits,
            c.admission_reserve) == ("extend", "retracts-decode", "caller-page-floor",
                                     "prompt", 2 if released(target, "0.5.12") else 1)
    assert c.decode_steps and c.refusal_evicts
    # before 0.5.18 the salt travels as the extra key: a caller's has no field of its own
    assert ("extra_key" in c.scope_kinds) == released(target, SALTED)
    assert {what for what, _, _ in c.replicated} and all(fn for _, fn, _ in c.replicated)


def test_a_retraction_keeps_only_what_the_request_had_checkpointed(target: Target) -> None:
    """SGLang's release_req releases without inserting: the prompt's pages, published
    at the end of its extend, stay; the decoded tokens, inserted only when a request
    finishes, go. A finished request's decoded tokens are reused."""
    history = PROMPT + OUT
    retracted = run(target, [*decoded("A"), ops.preempt("A"), ops.admit("B", [*history, 1])])
    assert retracted[-2].status == "done" and retracted[-2].used_blocks == 0
    assert retracted[-1].value["reused_tokens"] == 8
    finished, found = judged(target, [*decoded("A"), ops.free("A"),
                                      ops.admit("B", [*history, 1])])
    if released(target, "0.5.9"):
        assert found == [] and finished[-1].value["reused_tokens"] == 12
    else:  # finding 20: 0.5.6-0.5.8 insert a finished request's prompt only
        assert [v.oracle for v in found] == ["count"]
        assert finished[-1].value["reused_tokens"] == 8


def test_a_retracted_request_resumes_with_its_output_so_far(target: Target) -> None:
    reports = run(target, [*decoded("A"), ops.preempt("A"), ops.admit("A", PROMPT + OUT),
                           ops.commit("A", 13), ops.append("A", [7]), ops.commit("A", 14),
                           ops.free("A")])
    resumed = reports[-5]
    assert (resumed.status, resumed.value["reused_tokens"]) == ("done", 8)
    assert reports[-1].leaks == ()


def test_decoded_tokens_enter_the_tree_only_when_the_request_ends(target: Target) -> None:
    live = run(target, [*decoded("A"), ops.admit("B", [*PROMPT, *OUT, 1]), ops.free("B"),
                        ops.free("A")])
    assert live[-3].value["reused_tokens"] == 8  # A still decoding: its prompt only


@pytest.mark.parametrize(("first_chunk", "scheduled"), [
    pytest.param(6, 4, id="cut-to-a-page"), pytest.param(2, 4, id="at-least-a-page"),
    pytest.param(9, 8, id="cut-to-two-pages"), pytest.param(30, 18, id="the-whole-prompt")])
def test_prefill_adder_cuts_the_first_chunk_to_whole_pages(target: Target, first_chunk: int,
                                                           scheduled: int) -> None:
    reports = run(target, [ops.admit("A", list(range(100, 118)), first_chunk=first_chunk),
                           ops.free("A")])
    assert reports[0].value["scheduled_tokens"] == scheduled


def test_a_request_freed_between_its_chunks_holds_nothing_after(target: Target) -> None:
    """A's first chunk (4 of 9 tokens) is computed, then A ends before its next chunk:
    to 0.5.8 the scheduler freed A's row at the chunk, so its release takes a row first
    (no double free, no row left held); from 0.5.9 A kept its row. A later request
    still reuses the page A checkpointed; every oracle silent, nothing leaked."""
    a = list(range(100, 109))
    reports = run(target, [ops.admit("A", a, first_chunk=4), ops.commit("A", 4),
                           ops.admit("B", list(range(300, 318))), ops.free("A"),
                           ops.admit("C", a), ops.free("C"), ops.free("B")])
    assert reports[3].integrity == () and reports[-1].leaks == ()
    assert reports[4].value["reused_tokens"] == 4


def test_a_refused_next_chunk_takes_no_row(target: Target) -> None:
    """Four pages: A's first chunk holds one; B's 7 tokens hold two and its second
    decode step the last; A's next chunk finds no page and is refused, which leaves the
    request rows as they were (to 0.5.8 the allocation had taken a new row for A before
    its pages failed), so nothing is held at the end."""
    b = [ops.admit("B", list(range(300, 307))), ops.commit("B", 7),
         ops.append("B", [1]), ops.commit("B", 8), ops.append("B", [2]), ops.commit("B", 9)]
    reports = run(target, [ops.admit("A", list(range(100, 109)), first_chunk=4),
                           ops.commit("A", 4), *b, ops.reserve("A", 9), ops.free("B"),
                           ops.free("A")], num_blocks=4)
    assert reports[7].used_blocks == 4 and reports[8].status == "refused"
    assert reports[-1].leaks == ()


def test_a_later_chunk_is_scheduled_as_asked_once_the_last_one_is_computed(
        target: Target) -> None:
    reports = run(target, [ops.admit("A", list(range(100, 118)), first_chunk=4),
                           ops.reserve("A", 11), ops.commit("A", 4), ops.reserve("A", 11),
                           ops.commit("A", 11), ops.admit("B", list(range(100, 118))),
                           ops.free("B"), ops.free("A")])
    assert reports[1].status == "skipped" and reports[3].value == 11
    assert reports[5].value["reused_tokens"] == 8  # the checkpointed pages, not 11


@pytest.mark.parametrize(("budget", "chunks"), [
    pytest.param(8, [8, 16, 24, 30], id="budget-of-two-pages"),
    pytest.param(6, [4, 8, 12, 16, 20, 24, 28, 30], id="budget-cut-to-a-page")])
def test_prefill_adder_cuts_the_chunks_under_the_servers_budget(target: Target, budget: int,
                                                                chunks: list[int]) -> None:
    """Opened with a chunk budget, the step's rem_chunk_tokens is the budget a server
    takes (whole pages) and PrefillAdder, not the op, cuts each chunk."""
    assert (target.open(16, B, CacheOptions(chunk_budget=budget)).chunking,
            target.open(16, B, CacheOptions(chunk_budget=budget)).chunk_budget) == \
        ("page-budget", budget // B * B)
    prompt = list(range(100, 130))
    op_list: list[Op] = [ops.admit("A", prompt)]
    for end in chunks[:-1]:
        op_list += [ops.commit("A", end), ops.reserve("A", 30)]
    reports = run(target, [*op_list, ops.commit("A", 30), ops.free("A")],
                  options=CacheOptions(chunk_budget=budget))
    assert [reports[0].value["scheduled_tokens"],
            *(r.value for r in reports[2:-2:2])] == chunks


@pytest.mark.parametrize(("tokens", "status"), [
    pytest.param(8, "done", id="8-of-16-free-tokens"),
    pytest.param(12, "refused", id="12-of-16-free-tokens"),
    pytest.param(16, "refused", id="16-of-16-free-tokens")])
def test_an_admission_keeps_a_page_free_beyond_its_prompt(target: Target, tokens: int,
                                                          status: str) -> None:
    """A pool of 8 pages with A holding 4: PrefillAdder admits B only when its prompt and
    a page are below the 16 free tokens (`admission_reserve`); before 0.5.12 its prompt
    alone (12 tokens fit)."""
    reports = run(target, [ops.admit("A", list(range(100, 116))), ops.commit("A", 16),
                           ops.admit("B", list(range(500, 500 + tokens)))], num_blocks=8)
    if tokens == 12 and not released(target, "0.5.12"):
        status = "done"
    assert reports[-1].status == status


def test_an_extra_key_equal_to_a_loras_id_reads_that_loras_kv(target: Target) -> None:
    """sgl-project/sglang#24638, still in this release: Req.__init__ joins the extra key
    and the LoRA id into one string, so a base request naming the id reuses the LoRA's
    KV (the count and provenance oracles both say so)."""
    if not released(target, SALTED):
        pytest.skip("before 0.5.18 the extra key is the salt's field (finding 4)")
    judge = Judge(target.open(16, B), 16)
    lora = Scope.lora("a", 1)
    found = [v for r in target.apply_all([
        ops.admit("L", list(range(100, 118)), lora), ops.commit("L", 18), ops.free("L"),
        ops.admit("K", list(range(100, 109)), Scope(extra_key=lora_id_text(1)))])
        for v in judge.observe(r)]
    assert [v.oracle for v in found] == ["count", "provenance"]
    assert "reused 8 tokens; the count oracle predicts 0" in found[0].message


def test_an_allocation_evicts_only_its_shortfall_from_0_5_17(target: Target) -> None:
    """`evict_from_tree_cache` asks the tree for the shortfall from 0.5.17
    (sgl-project/sglang#32016); before, for the allocation's whole size, so C's five
    pages with four free evict B's leaf beside A's (finding 19 of docs/conformance.md)."""
    engine, version = target.name.split()
    report = Report(f"{engine}=={version}", engine, version)
    check_all(target, report, [check_named("eviction_order")], 0, lambda _: None)
    found = report.checks[0]
    if released(target, "0.5.17"):
        assert found.status == "pass", found.message
    else:
        assert (found.status, found.oracle) == ("fail", "scenario")
        assert found.known["number"] == 19
        # the report's trace names the function where the finding lives
        assert found.went_through is not None
        assert any(f.endswith("common.py: evict_from_tree_cache") for f in found.went_through)


def released(target: Target, version: str) -> bool:
    """Whether `target`'s release is `version` or later."""
    return parse_version(target.name.split()[1]).key >= parse_version(version).key

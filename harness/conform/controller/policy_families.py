"""Families judged against the policies a contract documents, each expectation computed
from the contract's fields (blocks of B = 4 tokens, numbers checkable by hand):

    eviction_order       which cached block goes first under pressure
                         (`eviction_policy`); the judge also follows the order block by
                         block where it models the policy (`judge.ORDER_MODELS`)
    preemption_resume    a sequence preempted mid-decode and resumed with its output
                         tokens reuses what it computed (`preemption`; the counters of
                         resumed admissions, where the contract lists them)
    decode_preempts      a decode step with no block free: refused, or the scheduler
                         preempts the last running sequence (`decode_refusal`)
    scheduler_chunks     a prompt in the chunks the engine's scheduler makes
                         (`chunking`, `chunk_budget`, `long_prefill_threshold`)
    event_fields         what a BlockStored says beyond its hashes (`event_fields`)
    sliding_window       a cache with a window (`window`, `window_layout`): a prompt in
                         chunks and decoded past the window holds only the window's
                         blocks (the judge), and what it computed is reused, at its end
                         and in its middle
    window_off_page      a window of 10 tokens, not a whole number of blocks: a
                         request's prompt put into the cache stays its own (held, never
                         the cache's to evict) while it runs
    window_pool_short    the same window over a window pool smaller than the full one
                         (`window_pool`): an allocation that finds it short evicts window
                         KV below the window, and a later match ends before it

Each is skipped, saying why, where the contract lacks what it needs.
"""

from __future__ import annotations

from typing import Any

from harness.conform import ops
from harness.conform.controller.families import B, Check, Run, toks
from harness.conform.protocol import CacheOptions, Scope


def eviction_order(run: Run) -> None:
    """A and B (three full blocks each) computed and freed, A first; C needs five blocks
    of the four free: the policy names what goes. Least recently freed blocks, a
    request's last first (vLLM), and priority-then-LRU blocks (kvcache): A's last block;
    least recently used leaves (SGLang): A's whole leaf. Then A and B again reuse what
    is left (the count oracle, exact where the judge follows the order)."""
    a_steps = (len(run.reports), len(run.reports) + 2)  # A's admit .. free
    for seq, prompt in (("A", toks(100, 12)), ("B", toks(300, 12))):
        run.admit(seq, prompt)
        run.commit(seq, 12)
        run.free(seq)
    run.admit("C", toks(500, 20))
    run.expect_admitted("C (5 blocks, 4 free) is admitted, evicting")
    policy = run.contract.eviction_policy
    if run.contract.events:
        run.expect_evicted(f"C's admission evicts ({policy}) A's stored blocks", *a_steps,
                           "all" if policy == "lru-leaves" else "last")
    run.commit("C", 20)
    run.free("C")
    run.observed["A again (13 tokens) reuses"] = run.admit("A2", [*toks(100, 12), 1])
    run.free("A2")
    run.observed["B again (13 tokens) reuses"] = run.admit("B2", [*toks(300, 12), 1])
    run.free("B2")


def preemption_resume(run: Run) -> None:
    """A computes a 10-token prompt and decodes six tokens, is preempted, and resumes
    with its 16 tokens: it reuses what the contract's preemption keeps (every block it
    computed, freed and kept cached; or, retracted, only what it had published: its
    prompt's whole blocks where decoded tokens are published at the end), finishes, and
    a new request extending it reuses it all."""
    prompt, out = toks(100, 10), [900 + i for i in range(6)]
    run.admit("A", prompt)
    run.commit("A", 10)
    for i, t in enumerate(out):
        run.append("A", [t])
        run.commit("A", 11 + i)
    run.preempt("A")
    run.expect_preempted("preempt(A) preempts", ["A"])
    # a retraction keeps what was published: the prompt's blocks where decoded tokens
    # are published only when a request ends, all of it where a commit publishes
    retracted = run.contract.preemption == "retracts-decode" and \
        run.contract.matchable_at in ("extend", "prefill")
    kept = len(prompt) // B * B if retracted else run.cap(16)
    run.expect(f"A resumed with its prompt and output tokens reuses "
               f"({run.contract.preemption})", run.admit("A", prompt + out), kept)
    run.commit("A", 16)
    run.append("A", [906])
    run.commit("A", 17)
    run.free("A")
    run.expect("a new request extending A reuses", run.admit("B", [*prompt, *out, 906, 1]),
               run.cap(18))
    run.free("B")


def decode_preempts(run: Run) -> None:
    """A pool of 6: A holds 2 blocks, B (admitted later) the rest (less the blocks an
    engine keeps free beyond an admission, `admission_reserve`, which A's decode steps
    then take); A's next token needs a block. Under "preempts-last" the scheduler
    preempts B (the last running), A gets its block, and B resumes later reusing what it
    computed; under "refused" the decode is refused and works once B is freed."""
    run.admit("A", toks(100, 8))
    run.commit("A", 8)
    b = toks(500, (4 - run.contract.admission_reserve) * B)
    run.admit("B", b)
    run.commit("B", len(b))
    length = 8
    r = run.do(ops.append("A", [900]))
    while r.status == "done" and not r.preempted and length < 8 + run.contract.admission_reserve * B:
        length += 1
        run.commit("A", length)
        r = run.do(ops.append("A", [900 + length - 8]))
    if run.contract.decode_refusal == "preempts-last":
        run.expect_preempted("A's decode preempts", ["B"])
        run.expect("A's decode got a block", len(r.value) if r.status == "done" else None,
                   1)
        run.commit("A", length + 1)
        run.free("A")
        run.expect("B resumed reuses", run.admit("B", b), run.cap(len(b)))
        run.free("B")
        return
    run.expect_status("A's decode with no block free", "refused")
    run.free("B")
    run.expect("A's decode once B is freed allocates", run.append("A", [900 + length - 7]), 1)
    run.free("A")


CHUNKS = CacheOptions(chunk_budget=8, long_prefill_threshold=6)


def _chunk(run: Run, left: int, others: bool) -> int:
    """The scheduler's next chunk of a prompt with `left` tokens to compute, with or
    without other requests running or waiting (the contract's chunking rule).

    Under "page-budget" (SGLang's PrefillAdder; managers/schedule_policy.py, 0.5.23
    lines, 0.5.22's after them) the chunk is the rest up to the budget: a new request's
    rest, rounded up to whole pages (:1605, :1516), is cut where it exceeds the budget
    (:1646, :1549) to the page boundary at or below prefix + budget (:1665-1670,
    :1568-1573), which is prefix + budget, as its prefix (a match) and the budget
    (arg_groups/validation_hook.py:244, :243) are whole pages; a later chunk
    (add_chunked_req) is the rest up to the budget (:1181-1182, :1133-1134). The other
    requests take nothing from it: mixed chunking, where each running request's decode
    token would (:655, :624), is off by default."""
    c = run.contract
    chunk = min(left, c.chunk_budget or left)
    capped = c.chunking == "token-budget" or (c.chunking == "token-budget-shared" and others)
    if capped and c.long_prefill_threshold:
        chunk = min(chunk, c.long_prefill_threshold)
    return chunk


def scheduler_chunks(run: Run) -> None:
    """A 30-token prompt alone, then a 20-token prompt beside a running one, each
    scheduled step by step in the engine's chunks (a budget of 8 tokens a step, a
    long-prefill threshold of 6); then a prompt reusing the first one's blocks."""
    a = toks(100, 30)
    _chunks(run, "A", a, False, "A's chunks (tokens scheduled after each step), alone")
    run.commit("A", 30)
    b = toks(700, 20)
    _chunks(run, "B", b, True, "B's chunks, beside A")
    run.commit("B", 20)
    run.free("B")
    run.free("A")
    run.expect("C reuses A's prompt", run.admit("C", [*a, 1]), run.cap(31))
    run.free("C")


def _chunks(run: Run, seq: str, prompt: list[int], others: bool, what: str) -> None:
    """Admit `prompt` and reserve the rest of it step by step, each step's chunk computed
    before the next (an engine may schedule a chunk only then), expecting the
    scheduler's chunks (`_chunk`) at each step; stops at a step that schedules nothing."""
    steps = [len(run.reports)]
    run.admit(seq, prompt)
    want = [_chunk(run, len(prompt), others)]
    done = run.reports[-1].value["scheduled_tokens"] if run.reports[-1].status == "done" \
        else None
    while done is not None and done < len(prompt):
        run.commit(seq, done)
        steps.append(len(run.reports))
        done = run.reserve(seq, len(prompt))
        want.append(want[-1] + _chunk(run, len(prompt) - want[-1], others))
    run.expect_scheduled(what, steps, want)


FIELD_SCOPES: dict[str, Scope | None] = {
    "default": None, "salt 'x'": Scope(salt="x"), "LoRA a#1": Scope.lora("a", 1),
    "salt 'y' + LoRA b#2": Scope.lora("b", 2, salt="y")}


def event_fields(run: Run) -> None:
    """The same 18-token prompt computed cold in each scope: each field the contract
    says a BlockStored carries says what it should (its tokens, block size, parent, the
    scope's salt and LoRA, one extra-keys entry per block with the salt in the first
    only and the LoRA's name in every one, the full-attention group)."""
    prompt = toks(100, 18)
    scopes: list[dict[str, Any]] = []
    for i, (label, scope) in enumerate(FIELD_SCOPES.items()):
        first = len(run.reports)
        run.admit(f"F{i}", prompt, scope)
        run.commit(f"F{i}", 18)
        run.free(f"F{i}")
        scopes.append({"label": label, "scope": None if scope is None else scope.as_dict(),
                       "first": first, "last": len(run.reports) - 1})
        run.observed[f"{label}: BlockStored events"] = len(
            [e for r in run.reports[first:] for e in r.events if e.get("type") == "BlockStored"])
    run.expect_event_fields(scopes)


WINDOW = CacheOptions(window=8)


def sliding_window(run: Run) -> None:
    """A window of 8 tokens: A's 24-token prompt in chunks of 8, then five decoded
    tokens, each step releasing the blocks before the window (the judge counts them);
    once A is freed, B extending A's tokens reuses all its full blocks, and D sharing
    A's first 16 tokens reuses those (the window's blocks there were released but stay
    cached)."""
    a = toks(100, 24)
    run.admit("A", a, first_chunk=8)
    run.commit("A", 8)
    for end in (16, 24):
        run.expect(f"A's chunk up to {end} is scheduled", run.reserve("A", end), end)
        run.commit("A", end)
    out = [900 + i for i in range(5)]
    for i, t in enumerate(out):
        run.append("A", [t])
        run.commit("A", 25 + i)
    run.free("A")
    run.expect("B extending A's tokens reuses", run.admit("B", [*a, *out, 1]), run.cap(30))
    run.free("B")
    run.expect("D sharing A's first 16 tokens reuses", run.admit("D", [*a[:16], *toks(700, 8)]),
               min(16, run.cap(24)))
    run.free("D")


OFF_PAGE = CacheOptions(window=10)


def window_off_page(run: Run) -> None:
    """A window of 10 tokens, not a whole number of blocks, in a pool of 16: A's 15-token
    prompt is computed in one step and put into the cache at its end, where what A holds
    stays A's (an engine that frees window KV below the window there must still keep the
    part it shares locked for A); B (48 tokens, 12 blocks) then asks for more blocks than
    are free, so an admission may evict only what no live request holds; A decodes a
    token, and both end. The oracles judge each step (capacity and integrity: no block
    both A's own and the cache's to evict, none held by two requests)."""
    a = toks(100, 15)
    run.admit("A", a)
    run.expect_admitted("A (15 tokens, 4 blocks of 16) is admitted")
    run.commit("A", 15)
    if run.admit("B", toks(500, 48)) is not None:
        run.commit("B", 48)
        run.free("B")
    if run.append("A", [900]) is not None:
        run.commit("A", 16)
    run.free("A")


SHORT_POOL = CacheOptions(window=8, window_pool=8)


def window_pool_short(run: Run) -> None:
    """A window of 8 tokens over a window pool of 8 blocks (32 tokens; the full pool
    32): A's 32-token prompt in chunks of 8, each chunk a node of the tree, then a
    decoded token; an allocation that finds the window pool short (0.5.23's scheduler:
    the last chunk's, keeping a page in reserve; 0.5.10's caller: the decode step's)
    evicts the window KV of the least recently used node below A's window, its first 8
    tokens (SGLang tombstones the node and keeps its full KV). Once A is freed, B sharing A's first 12 tokens
    reuses 0: the 4 tokens past the tombstone do not fill a window (the count oracle
    says 12; the judge allows the shortfall only with tokens in the tree lacking window
    KV, windowGapTokens)."""
    a = toks(100, 32)
    run.admit("A", a, first_chunk=8)
    run.commit("A", 8)
    for end in (16, 24, 32):
        run.expect(f"A's chunk up to {end} is scheduled", run.reserve("A", end), end)
        run.commit("A", end)
    run.append("A", [900])
    run.commit("A", 33)
    run.observed["tokens without window KV after A's decode step"] = \
        run.reports[-1].stats.harness.get("windowGapTokens")
    run.free("A")
    run.expect("B sharing A's first 12 tokens reuses", run.admit("B", [*a[:12], *toks(700, 12)]),
               0)
    run.free("B")


CHECKS: tuple[Check, ...] = (
    Check("eviction_order", "eviction order", "under pressure the contract's policy names "
          "the block that goes first", 10, eviction_order),
    Check("preemption_resume", "preemption", "preempted mid-decode, resumed with its "
          "output tokens: reuses what it computed", 32, preemption_resume,
          needs=("preemption",)),
    Check("decode_preempts", "preemption", "a decode step with no block free: refused, or "
          "the last running request preempted", 6, decode_preempts,
          needs=("decode_blocks",)),
    Check("scheduler_chunks", "scheduler chunks", "prompts in the scheduler's chunks, alone "
          "and beside another", 32, scheduler_chunks, needs=("scheduler_chunks",),
          options=CHUNKS, optional=("long_prefill_threshold",)),
    Check("event_fields", "router events", "BlockStored fields beyond the hash, per scope",
          32, event_fields, needs=("events", "event_fields")),
    Check("sliding_window", "sliding window", "a window of 8: chunks and decode release "
          "blocks before it; what was computed is reused", 32, sliding_window,
          options=WINDOW),
    Check("window_off_page", "sliding window", "a window of 10, not a whole number of "
          "blocks: a request's prompt put into the cache stays its own while it runs", 16,
          window_off_page, options=OFF_PAGE),
    Check("window_pool_short", "sliding window", "a window pool smaller than the full "
          "one: an allocation evicts window KV below the window, and a later match ends "
          "before it", 32, window_pool_short, options=SHORT_POOL),
)

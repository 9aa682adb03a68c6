"""The harness's scenario families in each engine's terms, run under every oracle.

Each `Check` drives a fresh cache through one family (`Run`: ops as data, every step
judged by `harness.conform.controller.judge.Judge`) and declares the expectations the
oracles cannot state alone: that a cold admission reuses nothing, that a warm one reuses
what the contract's units allow, what an abort leaves behind under the contract's
`matchable_at`. They are data (`harness.conform.controller.expectations`), judged on the
step reports, so a replay of the op list judges them again. Blocks hold B = 4 tokens,
so every number can be checked by hand. Every family frees what it admitted: the last
step's leak report is the leak check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from harness.conform import ops
from harness.conform.controller.expectations import (
    Expectation,
    Unmet,
    event_hashes,
    first_stored_hash,
    freed_by,
    judge,
    result_of,
    scheduled_by,
)
from harness.conform.controller.judge import Judge, Violation
from harness.conform.controller.targets import Target
from harness.conform.ops import Op
from harness.conform.protocol import CacheOptions, Contract, OptionName, Scope, lora_id_text
from harness.conform.worker.session import Status, StepReport

B = 4  # tokens per block (a vLLM block, an SGLang page)


def toks(start: int, n: int) -> list[int]:
    """`n` consecutive token ids from `start`."""
    return list(range(start, start + n))


class Run:
    """One check's cache, its op list, what the oracles found, the family's declared
    expectations and what it observed."""

    def __init__(self, target: Target, num_blocks: int,
                 options: CacheOptions | None = None) -> None:
        self.target = target
        self.num_blocks = num_blocks
        self.options = options or CacheOptions()
        self.contract: Contract = target.open(num_blocks, B, options)
        self.judge = Judge(self.contract, num_blocks)
        self.ops: list[Op] = []
        self.reports: list[StepReport] = []
        self.violations: list[Violation] = []
        self.expectations: list[Expectation] = []
        self.observed: dict[str, Any] = {}
        self.live: set[str] = set()  # sequences admitted and not freed (nor preempted)

    def do(self, op: Op) -> StepReport:
        """Apply `op` and judge the step."""
        report = self.target.apply(op)
        if report.status == "done" and op.seq is not None and op.kind in ("admit", "free"):
            (self.live.add if op.kind == "admit" else self.live.discard)(op.seq)
        self.live.difference_update(report.preempted)
        self.ops.append(op)
        self.reports.append(report)
        self.violations += self.judge.observe(report)
        return report

    def admit(self, seq: str, tokens: list[int], scope: Scope | None = None,
              first_chunk: int | None = None) -> int | None:
        """Reused tokens, or None when the admission did not happen."""
        r = self.do(ops.admit(seq, tokens, scope, first_chunk))
        return r.value["reused_tokens"] if r.status == "done" else None

    def commit(self, seq: str, num_tokens: int) -> None:
        """Commit; expected done (a skip means the family's bookkeeping is off)."""
        self.do(ops.commit(seq, num_tokens))
        self._expect_done()

    def reserve(self, seq: str, num_tokens: int) -> int | None:
        """Tokens scheduled, or None when refused."""
        r = self.do(ops.reserve(seq, num_tokens))
        return r.value if r.status == "done" else None

    def append(self, seq: str, tokens: list[int]) -> int | None:
        """Blocks the append allocated, or None when refused."""
        r = self.do(ops.append(seq, tokens))
        return len(r.value) if r.status == "done" else None

    def free(self, seq: str) -> None:
        """Free; expected done."""
        self.do(ops.free(seq))
        self._expect_done()

    def preempt(self, seq: str) -> tuple[str, ...]:
        """Preempt; the sequences the step preempted (a skip is a failure of the
        family)."""
        r = self.do(ops.preempt(seq))
        self._expect_done()
        return r.preempted

    def evict(self, num_blocks: int) -> int | None:
        """Blocks evicted."""
        r = self.do(ops.evict(num_blocks))
        return r.value if r.status == "done" else None

    def _expect_done(self) -> None:
        self.expectations.append(Expectation("done", {"step": len(self.reports) - 1}))

    def expect(self, what: str, got: int | None, want: int | None) -> None:
        """Expect the op just done to have returned `want`; `got` is what it returned
        (as `admit`, `reserve`, `append` and `evict` return it), recorded under `what`."""
        step = len(self.reports) - 1
        assert got == result_of(self.reports[step]), f"{what}: expect() reads the op just done"
        self.observed[what] = got
        self.expectations.append(Expectation("result", {"step": step, "what": what,
                                                        "want": want}))

    def expect_freed(self, what: str, want: int) -> None:
        """Expect the op just done to have given back `want` blocks (`freed_by`)."""
        step = len(self.reports) - 1
        self.observed[what] = freed_by(self.reports, step)
        self.expectations.append(Expectation("freed", {"step": step, "what": what,
                                                       "want": want}))

    def expect_admitted(self, what: str) -> None:
        """Expect the op just done, an admission, to have happened."""
        step = len(self.reports) - 1
        self.observed[what] = self.reports[step].status == "done"
        self.expectations.append(Expectation("admitted", {"step": step, "what": what}))

    def expect_preempted(self, what: str, want: list[str]) -> None:
        """Expect the op just done to have preempted the sequences `want`, in order."""
        step = len(self.reports) - 1
        self.observed[what] = list(self.reports[step].preempted)
        self.expectations.append(Expectation("preempted", {"step": step, "what": what,
                                                           "want": want}))

    def expect_status(self, what: str, want: Status) -> None:
        """Expect the op just done to have ended with status `want`."""
        step = len(self.reports) - 1
        self.observed[what] = self.reports[step].status
        self.expectations.append(Expectation("status", {"step": step, "what": what,
                                                        "want": want}))

    def expect_scheduled(self, what: str, steps: list[int], want: Sequence[int | None]
                         ) -> None:
        """Expect the ops at `steps` (admissions and reserves of one sequence) to have
        scheduled it up to `want` tokens, one entry per step (`scheduled_by`)."""
        self.observed[what] = [scheduled_by(self.reports[s]) for s in steps]
        self.expectations.append(Expectation("scheduled", {"steps": steps, "what": what,
                                                           "want": list(want)}))

    def expect_evicted(self, what: str, first: int, last: int, which: str) -> None:
        """Expect the op just done to have removed the blocks the steps `first`..`last`
        stored (`which` "all"), or the last of them ("last")."""
        step = len(self.reports) - 1
        self.observed[what] = event_hashes(self.reports[step:], "BlockRemoved")
        self.expectations.append(Expectation("evicted", {
            "step": step, "what": what, "first": first, "last": last, "which": which}))

    def expect_event_fields(self, scopes: list[dict[str, Any]]) -> None:
        """Expect each scope's cold prompt (`scopes`: label, scope, first, last, as
        `distinct_event_hashes` takes them) to carry the contract's event fields."""
        self.expectations.append(Expectation("event_fields", {"scopes": scopes}))

    def unmet(self) -> list[Unmet]:
        """The declared expectations that did not hold (`expectations.judge`)."""
        return judge(self.expectations, self.contract, self.reports)

    def cap(self, prompt_len: int) -> int:
        """Tokens a warm prompt of `prompt_len` reuses once all of it is cached: all but
        the last token (the contract's `unreused_tail`), cut to whole blocks unless the
        contract reuses partial ones."""
        reach = max(0, prompt_len - self.contract.unreused_tail)
        return reach if self.contract.partial_reuse else reach // B * B


Need = Literal["scopes", "lora", "events", "extra_key", "preemption", "scheduler_chunks",
               "event_fields", "decode_blocks"]
# what a family needs from the engine, and why a contract without it skips the family
_NEEDS: dict[str, tuple[Callable[[Contract], bool], str]] = {
    "scopes": (lambda c: bool(c.scope_kinds), "the engine keys its cache on no scope "
               "(salt, LoRA): every scope shares, so the family could only pass"),
    "lora": (lambda c: "lora" in c.scope_kinds, "the engine keys its cache on no LoRA "
             "adapter: every adapter shares, so the family could only pass"),
    "events": (lambda c: c.events, "the engine publishes no router events: there is no "
               "event hash to compare"),
    "extra_key": (lambda c: "extra_key" in c.scope_kinds, "the engine's cache key takes "
                  "no caller extra key (Contract.scope_kinds)"),
    "preemption": (lambda c: c.preemption != "none", "the adapter drives no preemption "
                   "path of the engine's (Contract.preemption is 'none')"),
    "scheduler_chunks": (lambda c: not c.chunking.startswith("caller"), "the caller "
                         "chooses each chunk's size (Contract.chunking; chunked_admission "
                         "covers those)"),
    "decode_blocks": (lambda c: not c.allocates_ahead, "the engine takes decode blocks "
                      "ahead of the tokens: what a decode step needs is its own"),
    "event_fields": (lambda c: bool(c.event_fields), "the contract lists no event field "
                     "beyond the hashes")}


@dataclass(frozen=True)
class Check:
    """A family run on a fresh cache of `num_blocks` blocks, opened with `options` (less
    those in `optional` the engine does not honour: an engine whose scheduler has no
    long-prefill threshold runs a chunking family without one); skipped (with the
    reason) on an engine whose contract lacks something in `needs` or does not honour
    the other options."""

    name: str
    family: str
    about: str
    num_blocks: int
    body: Callable[[Run], None] = field(repr=False)
    needs: tuple[Need, ...] = ()
    options: CacheOptions = field(default_factory=CacheOptions)
    optional: tuple[OptionName, ...] = ()

    def options_for(self, contract: Contract) -> CacheOptions:
        """The options the family opens its cache with on `contract`'s engine."""
        return replace(self.options, **{name: None for name in self.optional
                                        if name not in contract.options})

    def skip_reason(self, contract: Contract,
                    open_with: Callable[[CacheOptions], Contract] | None = None) -> str | None:
        """Why this family cannot judge `contract`'s engine (a cache opened with no
        options); None when it can (an option it does not honour: with the engine's
        reason, the contract's citations named `options` and `options.<name>` for
        that option). Where every option is honoured,
        `needs` is judged on `open_with(options)`, the contract of the cache the family
        opens (an engine's scheduler may cut the chunks only under a budget)."""
        options = self.options_for(contract)
        unhonoured = [n for n in options.names() if n not in contract.options]
        judged = contract
        if open_with is not None and options.names() and not unhonoured:
            judged = open_with(options)
        missing = [why for has, why in map(_NEEDS.__getitem__, self.needs) if not has(judged)]
        if unhonoured:  # with the engine's reasons, where the contract cites them
            cited = {"options", *(f"options.{n}" for n in unhonoured)}
            why = "".join(f"; {text}" for name, text in contract.citations if name in cited)
            missing.append(f"the adapter opens no cache with {', '.join(unhonoured)} "
                           f"(it honours {list(contract.options) or 'no options'}{why})")
        return "; ".join(missing) or None


# -- the families ---------------------------------------------------------------------------


def cold_then_warm(run: Run) -> None:
    a = toks(100, 18)
    run.expect("cold admission reuses", run.admit("A", a), 0)
    run.commit("A", 18)
    run.free("A")
    run.expect("warm admission of 18 tokens reuses", run.admit("A2", a), run.cap(18))
    run.commit("A2", 18)
    run.free("A2")
    run.expect("warm 16 tokens (a block multiple) reuses", run.admit("B", toks(100, 16)),
               run.cap(16))
    run.free("B")


def shared_system_prompt(run: Run) -> None:
    system = toks(1, 12)
    for i in range(3):
        run.expect(f"user {i} reuses", run.admit(f"U{i}", system + toks(1000 * (i + 1), 5)),
                   min(12, run.cap(17)) if i else 0)
        run.commit(f"U{i}", 17)
    for i in range(3):
        run.free(f"U{i}")


def multi_turn(run: Run) -> None:
    turn1 = toks(1, 10)
    run.admit("T1", turn1)
    run.commit("T1", 10)
    answer = toks(50, 6)
    for i, t in enumerate(answer):
        run.append("T1", [t])
        run.commit("T1", 11 + i)
    run.free("T1")
    # turn 1's 16 computed tokens (prompt and answer) are 4 whole blocks
    run.expect("turn 2 reuses turn 1 and its answer",
               run.admit("T2", turn1 + answer + toks(200, 5)), min(16, run.cap(21)))
    run.free("T2")


def branches(run: Run) -> None:
    root = toks(1, 8)
    run.admit("X", root + toks(100, 9))
    run.commit("X", 17)
    run.free("X")
    run.expect("branch Y shares the root", run.admit("Y", root + toks(300, 9)),
               min(8, run.cap(17)))
    run.commit("Y", 17)
    run.free("Y")
    run.expect("X again finds its own branch", run.admit("X2", root + toks(100, 9)),
               run.cap(17))
    run.free("X2")
    run.expect("Y again finds its own branch", run.admit("Y2", root + toks(300, 9)),
               run.cap(17))
    run.free("Y2")


def eviction_under_pressure(run: Run) -> None:
    # B takes 7 blocks of the pool of 8 (fewer where the engine keeps blocks free
    # beyond an admission's prompt: its `admission_reserve`), more than A leaves free
    n = min(7, run.num_blocks - run.contract.admission_reserve)
    a, b = toks(100, 16), toks(500, n * B)
    run.admit("A", a)
    run.commit("A", 16)
    run.free("A")
    # n blocks in a pool of 8 holding A's 4: at least n - 4 of them must go
    run.admit("B", b)
    run.expect_admitted(f"B ({n} of 8 blocks) is admitted, evicting")
    run.commit("B", n * B)
    run.free("B")
    run.observed["A after the pressure reuses"] = run.admit("A2", a)
    run.free("A2")
    run.observed["explicit evict(2) evicted"] = run.evict(2)
    run.observed["B after evict(2) reuses"] = run.admit("B2", b)
    run.free("B2")


def refused_then_retried(run: Run) -> None:
    run.admit("A", toks(100, 24))  # 6 of 8 blocks, held
    run.commit("A", 24)
    run.expect("B (4 blocks, 2 free) is refused", run.admit("B", toks(700, 16)), None)
    run.free("A")
    run.expect("B retried once A is freed reuses", run.admit("B", toks(700, 16)), 0)
    run.commit("B", 16)
    run.free("B")


def abort_before_forward(run: Run) -> None:
    a = toks(100, 18)
    run.admit("A", a)  # never committed: aborted before its forward pass
    run.free("A")
    # blocks matchable at allocation stay cached with KV that was never written
    want = run.cap(18) if run.contract.matchable_at == "allocation" else 0
    run.expect(f"after the abort (matchable at {run.contract.matchable_at}) A2 reuses",
               run.admit("A2", a), want)
    run.free("A2")


def chunked_admission(run: Run) -> None:
    a = toks(100, 18)
    run.admit("A", a, first_chunk=8)
    run.commit("A", 8)
    # a contract matchable at the end of the prefill publishes no chunk of it
    first = 0 if run.contract.matchable_at == "prefill" else 8
    run.expect(f"B, while A is mid-prefill, reuses (matchable at "
               f"{run.contract.matchable_at})", run.admit("B", a), first)
    run.free("B")
    for end in (16, 18):
        run.expect(f"A's chunk up to {end} is scheduled", run.reserve("A", end),
                   18 if not run.contract.chunked_allocation else end)
        run.commit("A", end)
    run.free("A")
    run.expect("after all chunks C reuses", run.admit("C", a), run.cap(18))
    run.free("C")


def decode_growth(run: Run) -> None:
    prompt = toks(100, 6)
    run.admit("A", prompt)
    run.commit("A", 6)
    for i in range(7):
        grown = run.append("A", [900 + i])
        what = f"blocks allocated for decoded token {i}"
        if run.contract.allocates_ahead:  # more than the tokens need: only observed
            run.observed[what] = grown
        else:
            run.expect(what, grown, -(-(7 + i) // B) - -(-(6 + i) // B))
        run.commit("A", 7 + i)
    run.free("A")
    decoded = prompt + [900 + i for i in range(7)]
    run.expect("a prompt extending the decoded tokens reuses", run.admit("B", [*decoded, 1]),
               run.cap(14))
    run.free("B")


def live_blocks_survive_eviction(run: Run) -> None:
    """A sequence that reused a prefix and computed the rest (its last full block the
    cache's copy again) keeps every block it holds through an eviction of everything
    evictable, while another prompt takes the free blocks and writes them; its next
    forward pass reads its own KV (the provenance oracle checks that read)."""
    a = toks(100, 18)
    run.admit("A", a)
    run.commit("A", 18)
    run.free("A")
    run.admit("A2", a)
    run.commit("A2", 18)
    run.observed["evict(12) with A2 live evicted"] = run.evict(12)
    run.observed["B (4 blocks) admitted"] = run.admit("B", toks(500, 16)) is not None
    if "B" in run.live:
        run.commit("B", 16)
    run.append("A2", [900])
    run.commit("A2", 19)
    run.free("A2")
    if "B" in run.live:
        run.free("B")
    run.expect("A again reuses", run.admit("A3", a), run.cap(18))
    run.free("A3")


def pressure_spares_own_prefix(run: Run) -> None:
    """Under pool pressure an admission whose prefix is cached must not evict that
    prefix to make room for the rest of its prompt: it is refused, or admitted with
    blocks of its own (a pool of 5; C holds 2 blocks; B reuses A's 2 and needs 2 more)."""
    a = toks(100, 8)
    run.admit("A", a)
    run.commit("A", 8)
    run.free("A")
    run.admit("C", toks(500, 8))
    run.commit("C", 8)
    got = run.admit("B", a + toks(700, 8))
    run.observed["B (A's 8 tokens and 8 more) admitted"] = got is not None
    if got is not None:
        run.commit("B", 16)
        run.free("B")
    run.free("C")


def same_prompt_twice(run: Run) -> None:
    """Two sequences compute one prompt at once: both keep their KV while live, one
    copy stays cached for the next, and the other's blocks go back to the pool."""
    a = toks(100, 16)
    run.admit("A", a)
    run.admit("B", a)
    run.commit("A", 16)
    run.commit("B", 16)
    run.free("A")
    run.append("B", [900])
    run.commit("B", 17)
    run.free("B")
    run.expect("C then reuses the prompt", run.admit("C", [*a, 1]), run.cap(17))
    run.free("C")


def dedup_across_split_path(run: Run) -> None:
    """Two live sequences compute one 16-token prefix; before the second publishes it,
    two other prompts branch off it at 8 and at 4 tokens, splitting the tree's path for
    it into three nodes. The second's commit finds the whole prefix cached across them:
    an engine that deduplicates frees exactly its 4 duplicate blocks (and keeps the one
    after the prefix), one that does not keeps both copies; nothing leaks and nothing is
    freed twice when all end."""
    prefix = toks(100, 16)
    run.admit("A", prefix)
    run.admit("B", prefix + toks(300, B))
    run.commit("A", 16)
    run.admit("C", prefix[:8] + toks(400, B))
    run.commit("C", 12)
    run.admit("D", prefix[:4] + toks(500, B))
    run.commit("D", 8)
    run.commit("B", 16 + B)
    what = "B's commit frees its duplicate blocks"
    if run.contract.matchable_at == "commit":  # else B found A's blocks at admission
        run.expect_freed(what, 16 // B if run.contract.dedup_on_commit else 0)
    else:
        run.observed[what] = freed_by(run.reports, len(run.reports) - 1)
    for seq in "BACD":
        run.free(seq)


def decoded_then_edited(run: Run) -> None:
    """A prompt that repeats a finished sequence's prompt and decoded tokens but one
    reuses only what it shares with it: decoded tokens are cached at the positions they
    were decoded at (a cache that drops one from its record shifts the rest)."""
    prompt = toks(100, 6)
    run.admit("A", prompt)
    run.commit("A", 6)
    out = [900 + i for i in range(7)]
    for i, t in enumerate(out):
        run.append("A", [t])
        run.commit("A", 7 + i)
    run.free("A")
    edited = prompt + out[:2] + out[3:] + toks(300, 6)  # drops out[2]
    run.expect("the edited prompt reuses only the 8 tokens it shares",
               run.admit("B", edited), min(8, run.cap(len(edited))))
    run.free("B")


def repeated_blocks(run: Run) -> None:
    """Blocks whose tokens repeat, at other positions and after other prefixes: each is a
    block of its own, in the tree and in the router events (a block's hash chains its
    prefix, or a router conflates them)."""
    block = toks(7, B)
    a = toks(20, B) + block + block + [1]
    b = toks(50, B) + block + [2]
    for seq, prompt in (("A", a), ("B", b)):
        run.admit(seq, prompt)
        run.commit(seq, len(prompt))
        run.free(seq)
    run.expect("A again reuses its blocks", run.admit("A2", a), run.cap(len(a)))
    run.free("A2")
    run.expect("a prompt starting with the repeated block reuses", run.admit("C", [*block, 3]),
               0)
    run.free("C")


SCOPES: dict[str, Scope | None] = {
    "default": None,
    "salt 'x'": Scope(salt="x"),
    "LoRA x#1": Scope.lora("x", 1),
    "LoRA x#2 (same name)": Scope.lora("x", 2),
    "LoRA y#1 (same id, same files)": Scope.lora("y", 1),
    "LoRA x#3 at x#1's files": Scope.lora("x", 3, "/loras/1"),
    "salt 'x' + LoRA x#1": Scope.lora("x", 1, salt="x"),
    "salt = LoRA id 1's text": Scope(salt=lora_id_text(1)),
    "salt 'x' + LoRA id 1's text (the two joined)": Scope(salt="x" + lora_id_text(1)),
    "salt 'y' (a LoRA name)": Scope(salt="y"),
}


def scope_isolation(run: Run) -> None:
    """Each scope computes the same prompt once, in turn, then again. A scope whose
    contract key equals an earlier one's shares by contract (the count oracle predicts
    it); any other sharing is a violation."""
    _isolated(run, SCOPES, "S", "R")


def _isolated(run: Run, scopes: dict[str, Scope | None], first: str, again: str) -> None:
    a = toks(100, 18)
    keys = {label: run.contract.scope_key(s) for label, s in scopes.items()}
    for i, (label, scope) in enumerate(scopes.items()):
        earlier = [other for other in list(scopes)[:i] if keys[other] == keys[label]]
        run.expect(f"{label} reuses" + (f" (same key as {earlier[0]})" if earlier else ""),
                   run.admit(f"{first}{i}", a, scope), run.cap(18) if earlier else 0)
        run.commit(f"{first}{i}", 18)
        run.free(f"{first}{i}")
    for i, (label, scope) in enumerate(scopes.items()):
        run.expect(f"{label} again reuses", run.admit(f"{again}{i}", a, scope), run.cap(18))
        run.free(f"{again}{i}")


EXTRA_KEY_SCOPES: dict[str, Scope | None] = {
    "LoRA a#1": Scope.lora("a", 1),
    "extra key = LoRA a#1's id": Scope(extra_key=lora_id_text(1)),
    "extra key = LoRA a#1's name": Scope(extra_key="a"),
    "default": None,
    "salt 'k'": Scope(salt="k"),
    "extra key 'k' (a salt's value)": Scope(extra_key="k"),
    "extra key 'k' + LoRA a#1": Scope(lora_name="a", lora_id=1, lora_path="/loras/1",
                                      extra_key="k"),
    "extra key 'k' + LoRA a#1's id (the two joined)": Scope(extra_key="k" + lora_id_text(1)),
    "salt 'k' + extra key 'k'": Scope(salt="k", extra_key="k"),
}


def extra_key_isolation(run: Run) -> None:
    """A caller's extra key is a namespace of its own: a base-model request whose extra
    key equals a LoRA adapter's id (which any client can compute for a static adapter)
    or name, or the LoRA's id joined to another extra key, must not reach that LoRA's
    KV, nor an extra key a salt's. Each scope computes one prompt in turn, then again;
    sharing only where the contract's keys are equal (sgl-project/sglang#24638)."""
    _isolated(run, EXTRA_KEY_SCOPES, "K", "Q")


def lora_name_repointed(run: Run) -> None:
    """A LoRA name re-pointed at another adapter (a new id and new files, as when a
    server reloads an adapter under its name) reuses none of the KV the first adapter
    computed: its weights differ (vllm-project/vllm#30931). The first adapter then
    finds its own KV again."""
    a = toks(100, 18)
    run.admit("A", a, Scope.lora("x", 1))
    run.commit("A", 18)
    run.free("A")
    run.expect("LoRA x re-pointed from /loras/1 (id 1) to /loras/2 (id 2) reuses",
               run.admit("B", a, Scope.lora("x", 2)), 0)
    run.commit("B", 18)
    run.free("B")
    run.expect("LoRA x at /loras/1 again reuses", run.admit("A2", a, Scope.lora("x", 1)),
               run.cap(18))
    run.free("A2")


# scopes that no release keys together: a router must still tell them apart
EVENT_SCOPES: dict[str, Scope | None] = {
    "default": None, "salt 'x'": Scope(salt="x"), "LoRA a#1": Scope.lora("a", 1),
    "LoRA a#2": Scope.lora("a", 2), "salt 'x' + LoRA a#1": Scope.lora("a", 1, salt="x")}


def scope_event_hashes(run: Run) -> None:
    """The same prompt computed in each scope: two scopes that differ in a kind the
    contract says reaches event hashes must publish different hashes for block 0 (a
    router keyed on the hashes would send one scope's requests to the other's KV)."""
    a = toks(100, 18)
    scopes = []
    for i, (label, scope) in enumerate(EVENT_SCOPES.items()):
        first = len(run.reports)
        run.admit(f"E{i}", a, scope)
        run.commit(f"E{i}", 18)
        run.free(f"E{i}")
        scopes.append({"label": label, "scope": None if scope is None else scope.as_dict(),
                       "first": first, "last": len(run.reports) - 1})
        run.observed.setdefault("block 0 hash per scope", {})[label] = \
            first_stored_hash(run.reports[first:])
    run.expectations.append(Expectation("distinct_event_hashes", {"scopes": scopes}))


CHECKS: tuple[Check, ...] = (
    Check("cold_then_warm", "cold then warm", "a prompt reused once computed, in the "
          "contract's units", 32, cold_then_warm),
    Check("shared_system_prompt", "shared system prompt", "users sharing a 12-token system "
          "prompt, all live", 32, shared_system_prompt),
    Check("multi_turn", "multi-turn chat", "turn 2 reuses turn 1 and its decoded answer", 32,
          multi_turn),
    Check("branches", "branches", "two branches off one root, each found again", 32,
          branches),
    Check("eviction_under_pressure", "eviction", "a pool of 8 blocks: an admission evicts; "
          "explicit eviction", 8, eviction_under_pressure),
    Check("refused_then_retried", "refused admissions", "a refusal changes nothing and is "
          "fair; the retry succeeds", 8, refused_then_retried),
    Check("abort_before_forward", "aborts", "a sequence freed before its forward pass", 32,
          abort_before_forward),
    Check("chunked_admission", "chunked admissions", "a prompt scheduled in chunks; a "
          "concurrent reader of its first chunk", 32, chunked_admission),
    Check("decode_growth", "decode growth", "one block per B decoded tokens; decoded blocks "
          "reused", 32, decode_growth),
    Check("live_blocks_survive_eviction", "eviction", "a live sequence's blocks survive an "
          "eviction of everything evictable and a new prompt taking the free blocks", 12,
          live_blocks_survive_eviction),
    Check("pressure_spares_own_prefix", "eviction", "under pressure an admission evicts "
          "nothing it reuses", 5, pressure_spares_own_prefix),
    Check("same_prompt_twice", "shared system prompt", "one prompt computed by two live "
          "sequences at once: one copy cached, the other freed", 32, same_prompt_twice),
    Check("dedup_across_split_path", "shared system prompt", "one prefix computed twice "
          "while other prompts split its path: exactly the duplicates freed", 32,
          dedup_across_split_path),
    Check("decoded_then_edited", "decode growth", "a prompt dropping one decoded token "
          "reuses only the prefix it shares", 32, decoded_then_edited),
    Check("repeated_blocks", "router events", "equal blocks at other positions and after "
          "other prefixes stay distinct", 32, repeated_blocks),
    Check("scope_isolation", "scope isolation", "salts, LoRA names, ids and files, equal "
          "values in different fields", 64, scope_isolation, needs=("scopes",)),
    Check("lora_name_repointed", "scope isolation", "a LoRA name re-pointed at another "
          "adapter reuses none of the first adapter's KV", 32, lora_name_repointed,
          needs=("lora",)),
    Check("extra_key_isolation", "scope isolation", "a caller extra key equal to a LoRA's "
          "id or name, or joined with one, reaches no other scope's KV", 64,
          extra_key_isolation, needs=("extra_key",)),
    Check("scope_event_hashes", "router events", "distinct scopes publish distinct block "
          "hashes, as far as the contract says scopes reach them", 32, scope_event_hashes,
          needs=("scopes", "events")),
)


"""One op applied to a `CacheUnderTest`, reported with everything the oracles need.

`Session` runs where the cache runs (in the harness's process for kvcache, inside the
engine's worker otherwise), so both send the judge the same `StepReport`s. It keeps a
small model of each live sequence (tokens, scheduled, committed) and *skips* an op that
is not valid at its point (a commit past what was scheduled, an op on a sequence that is
not live, a resumption whose tokens are not the preempted sequence's): any sub-list of
an op list replays, which is what shrinking needs. A sequence the engine preempted
(a `preempt` op, or its scheduler for a decode step that got no block) leaves the live
ones; an admit of its id with its tokens so far resumes it. Standard library only.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from harness.conform.ops import Op
from harness.conform.protocol import Admission, CacheUnderTest, Scope, Stats, preemptible
from harness.conform.stubs import StubUsedError

Status = Literal["done", "refused", "skipped", "raised"]


@dataclass(frozen=True)
class StepReport:
    """What one op did, and the cache's state right after it.

    status: "done", "refused" (the cache said no; it must have changed nothing),
    "skipped" (not valid at this point; the cache was not called) or "raised" (the
    cache raised: `detail` has the exception and where it was raised). `value` is the
    op's result as JSON (admit: reused_tokens, block_ids, scheduled_tokens). `log` and
    `events` are the harness events and router events the op produced; `leaks` is the
    leak report, taken only when no sequence is live (None otherwise); `preempted` the
    sequences the op preempted, in order (the op's own, or the scheduler's victims).
    """

    op: Op
    status: Status
    value: Any = None
    detail: str = ""
    log: tuple[dict[str, Any], ...] = ()
    events: tuple[dict[str, Any], ...] = ()
    used_blocks: int = 0
    cached: tuple[str, ...] | None = ()
    stats: Stats = field(default_factory=lambda: Stats({}, {}))
    integrity: tuple[str, ...] = ()
    leaks: tuple[str, ...] | None = None
    preempted: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (what the worker sends)."""
        return {"op": self.op.as_dict(), "status": self.status, "value": self.value,
                "detail": self.detail, "log": list(self.log), "events": list(self.events),
                "used_blocks": self.used_blocks,
                "cached": None if self.cached is None else list(self.cached),
                "stats": {"engine": self.stats.engine, "harness": self.stats.harness},
                "integrity": list(self.integrity),
                "leaks": None if self.leaks is None else list(self.leaks),
                "preempted": list(self.preempted)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "step report") -> StepReport:
        """Parse `as_dict`'s output; ValueError naming `where` for a malformed one."""
        try:
            stats = data["stats"]
            leaks, cached = data["leaks"], data["cached"]
            return cls(Op.from_dict(data["op"], f"{where}: op"), data["status"],
                       data["value"], str(data["detail"]), tuple(data["log"]),
                       tuple(data["events"]), int(data["used_blocks"]),
                       None if cached is None else tuple(str(h) for h in cached),
                       Stats(dict(stats["engine"]), dict(stats["harness"])),
                       tuple(data["integrity"]), None if leaks is None else tuple(leaks),
                       tuple(str(s) for s in data["preempted"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None


@dataclass
class _Live:
    tokens: list[int]  # its prompt and the tokens appended since
    scope: Scope | None
    scheduled: int  # tokens whose slots are allocated
    committed: int  # tokens whose KV is computed

    @property
    def length(self) -> int:
        return len(self.tokens)


class Session:
    """Applies ops to one fresh cache, in order (mutates the cache and itself)."""

    def __init__(self, cache: CacheUnderTest) -> None:
        self.cache = cache
        self.live: dict[str, _Live] = {}
        self.preempted: dict[str, _Live] = {}  # seq -> its tokens and scope, to resume with
        c = cache.contract
        self._preemptible = preemptible(cache) \
            if c.preemption != "none" or c.decode_refusal == "preempts-last" else None

    def apply(self, op: Op) -> StepReport:
        """Apply `op` (or skip it, saying why) and report the state after it. What the
        cache raises is reported ("raised"), but for StubUsedError, which propagates: a
        stub reached means the stub list, not the engine, is wrong."""
        why = self._invalid(op)
        if why:
            return self._report(op, "skipped", None, why)
        try:
            value = self._call(op)
        except StubUsedError:
            raise  # not the engine's failure: the run cannot be trusted (exit 2, not 1)
        except Exception as exc:  # whatever the engine raised is the finding: report it
            return self._report(op, "raised", None, _raised(exc))
        if value is _REFUSED:
            return self._report(op, "refused", None, "")
        return self._report(op, "done", value, "")

    def _invalid(self, op: Op) -> str:
        if op.kind == "evict":
            return ""
        assert op.seq is not None  # Op checks it for every other kind
        seq = self.live.get(op.seq)
        if op.kind == "admit":
            if seq is not None:
                return f"{op.seq!r} is already live"
            resume = self.preempted.get(op.seq)
            if resume is not None and (list(op.tokens), op.scope) != (resume.tokens,
                                                                      resume.scope):
                return (f"{op.seq!r} was preempted with {len(resume.tokens)} tokens in scope "
                        f"{resume.scope}: it resumes with exactly those")
            return ""
        if op.kind == "preempt" and self.cache.contract.preemption == "none":
            return "the contract has no preemption path"
        if seq is None:
            return f"{op.seq!r} is not live"
        if op.kind == "commit":
            n = op.num_tokens
            assert n is not None
            if not seq.committed <= n <= seq.scheduled:
                return (f"commit of {n} tokens: {seq.committed} are committed and "
                        f"{seq.scheduled} scheduled")
        if op.kind == "append" and seq.scheduled < seq.length:
            return f"append before all {seq.length} tokens are scheduled ({seq.scheduled})"
        if op.kind == "preempt" and self.cache.contract.preemption == "retracts-decode" \
                and seq.committed < seq.length:
            return (f"preempt before all {seq.length} tokens are computed ({seq.committed}): "
                    "the engine retracts only between decode steps")
        if op.kind == "reserve" and seq.committed < seq.scheduled \
                and self.cache.contract.chunking in ("caller-page-floor", "page-budget"):
            return (f"reserve before the {seq.scheduled} scheduled tokens are computed "
                    f"({seq.committed}): the engine schedules a chunk after the last one")
        if op.kind == "append" and self.cache.contract.decode_steps:
            if len(op.tokens) != 1:
                return f"append of {len(op.tokens)} tokens: the engine decodes one per step"
            if seq.committed < seq.length:
                return (f"append before all {seq.length} tokens are computed "
                        f"({seq.committed}): the engine decodes only after them")
        return ""

    def _call(self, op: Op) -> Any:
        c = self.cache
        seq = op.seq
        if op.kind == "evict":
            assert op.num_blocks is not None
            return c.evict(op.num_blocks)
        assert seq is not None
        if op.kind == "admit":
            got = c.admit(seq, list(op.tokens), op.scope, op.first_chunk)
            if got is None:
                return _REFUSED
            assert isinstance(got, Admission)
            self.preempted.pop(seq, None)
            self.live[seq] = _Live(list(op.tokens), op.scope, got.scheduled_tokens,
                                   got.reused_tokens)
            return {"reused_tokens": got.reused_tokens, "block_ids": list(got.block_ids),
                    "scheduled_tokens": got.scheduled_tokens}
        live = self.live[seq]
        if op.kind == "reserve":
            assert op.num_tokens is not None
            scheduled = c.reserve(seq, op.num_tokens)
            if scheduled is None:
                return _REFUSED
            live.scheduled = scheduled
            return scheduled
        if op.kind == "commit":
            assert op.num_tokens is not None
            c.commit(seq, op.num_tokens)
            live.committed = op.num_tokens
            return None
        if op.kind == "append":
            ids = c.append(seq, list(op.tokens))
            if ids is None:
                return _REFUSED
            live.tokens += op.tokens
            live.scheduled = live.length
            return list(ids)
        if op.kind == "preempt":
            assert self._preemptible is not None  # `_invalid` skips it otherwise
            self._preemptible.preempt(seq)
            return None
        c.free(seq)
        del self.live[seq]
        return None

    def _take_preempted(self) -> tuple[str, ...]:
        """The sequences the op preempted: out of the live ones, kept to resume."""
        if self._preemptible is None:
            return ()
        out = tuple(str(s) for s in self._preemptible.take_preempted())
        for seq in out:
            self.preempted[seq] = self.live.pop(seq)
        return out

    def _report(self, op: Op, status: Status, value: Any, detail: str) -> StepReport:
        """The report of `op`. Its log and events are copies: an adapter may log its own
        live objects (a sequence's token list, which later appends extend), and a
        report must say what the op did then, however much later it is read or sent."""
        c = self.cache
        preempted = self._take_preempted() if status in ("done", "raised") else ()
        leaks = None if self.live else tuple(c.leak_report())
        cached = c.cached_hashes()
        return StepReport(op, status, value, detail, tuple(copy.deepcopy(c.take_log())),
                          tuple(copy.deepcopy(c.take_events())), c.used_blocks(),
                          None if cached is None else tuple(cached), c.stats(),
                          tuple(c.check_integrity()), leaks, preempted)


_REFUSED = object()  # what `_call` returns for a refusal (None is a result too)


def _raised(exc: BaseException) -> str:
    """`Type: message (raised at FILE:LINE in FUNCTION)`: the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f" (raised at {last.filename}:{last.lineno} in {last.name})"
    return f"{type(exc).__name__}: {exc}{where}"

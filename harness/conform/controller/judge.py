"""The harness's oracles over one cache's step reports, under that engine's contract.

After every op (`Judge.observe`):

- count: the reuse oracle (`harness.oracle.model.ReuseOracle`, configured from the
  contract: tokens per block, partial reuse) replays the harness event log the adapter
  wrote; every admission must reuse what it predicts. Its model evicts nothing unless the
  contract says it models the engine's eviction (kvcache) or the judge follows the
  contract's `eviction_policy` itself (`ORDER_MODELS`: it tells the model which blocks
  each allocation evicted); otherwise it learns each eviction from the events (a
  device BlockRemoved of the full group whose chain the events spelled, cached in one
  scope only: `_learn_evictions`, under a contract with that group alone), and only
  where that cannot be told does a prediction become an upper bound. Whole-block contracts reuse whole
  blocks, and never the last prompt token; under a host tier whose `host_full_hit` is
  "all-but-last" a prompt cached whole whose last block the host holds reuses all but
  its last token (and the engine counts the whole prompt as hits), and one whose last
  block it lacks the device's hit: which blocks it holds follows the contract's
  `host_stores` (`Judge._host_holds`).
- eviction: where `ORDER_MODELS` has the contract's policy, every allocation takes the
  blocks the policy names (vLLM's free queue: the least recently freed first, a
  request's last block first), and what they held is what was evicted.
- provenance and capacity: the checked manager's own per-call checks
  (`harness.oracle.checked_manager.CallOracles`) over each op's logged events. The
  shadow KV store follows which tokens' KV each block holds: no read of KV that is not
  the reader's own, in its own scope (a contract whose blocks are matchable at
  allocation logs an implied commit there, which is how reading them is allowed). The
  blocks live sequences hold equal the engine's count (with duplicates a
  non-deduplicating engine keeps: at least that many, and exactly the distinct blocks
  its sequences were given); a refusal was fair (`CapacityOracle.check_refusal`, the
  duplicates such an engine keeps counted as unavailable; once the count oracle has
  lost track of an eviction, an admission needs the most any match up to its probe
  would; an admission that may load
  from a host tier whose `host_load_reserve` is "inflight-prefills" also needs what the
  live sequences still need to hold their tokens) and changed nothing (state,
  counters, events, log).
- events: the router events, folded by `harness.kv_index.EventIndex`, hold exactly the
  blocks the cache holds on its device (`cached_hashes`; a host tier's blocks are
  folded under their own medium; where the events name their group, `group_idx`, the
  other groups' are folded apart, by hash alone: `other_groups`; so are a host tier's
  whose events carry their hashes alone, `Contract.host_events` "hashes-only"), each
  BlockStored hangs from the block right before it (`_misplaced`: the full group's, and
  a window group's on the full group's chain; not a host's folded apart), and no op removes a block it keeps (a block moved
  between tiers is removed from one medium and stored on the other: no churn). A
  contract without events (`Contract.events`) publishes none; a drop in its
  cachedNumBlocks then tells the count oracle that blocks left the cache.
- count, state group: under a step `state_rule` (a hybrid model's recurrent state
  kept only at a scheduler step's end, or once per extend) a match reuses what the
  count oracle predicts for the full-attention group cut to the last state
  `state_group.StateGroup` kept
  (the stateNumBlocks gauge counts the state group's blocks, left out of the used
  blocks as a window group's are).
- count, window pool: under a "window-pool" layout whose window pool is smaller than
  the full one (`Contract.window_pool`), an allocation that finds it short evicts
  window KV from the tree and keeps the full KV (SGLang's tombstones), and a match ends
  before a node the window before which lacks window KV: once the tree holds tokens
  without window KV (the windowGapTokens gauge before the admission) a match may stop
  short of the count oracle's prediction, on a block boundary (`_window_gap_allows`);
  which tokens lack it is the engine's, and what an admission needs of the window pool
  is not judged (a refusal's fairness is judged only without it).
- capacity, window group: under a "full-and-window" layout the window group holds what
  `window_group.WindowGroup` says (the windowNumBlocks gauge), and the full-attention
  checks above count the used blocks less those.
- stats: each engine counter the contract lists equals what the admissions add up to;
  the harness-named gauges agree with the state.
- leaks: the plugin's leak check (`harness.oracle.leaks.leak_problems`) over the
  engine's own integrity and leak reports whenever nothing is live; integrity: the
  engine's own invariants after every op; the api oracle flags anything the engine
  raised.

Both the shadow store and the capacity oracle run with a window wider than any context:
their mode in which a sequence's positions are the blocks its events name (a chunked
admission holds only its first chunk's), while every position stays held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from harness.conform.controller.eviction import FreeQueue
from harness.conform.controller.state_group import StateGroup
from harness.conform.controller.window_group import WindowGroup
from harness.conform.ops import Op
from harness.conform.protocol import Contract, CounterMeaning
from harness.conform.worker.session import StepReport
from harness.oracle.capacity import CapacityError
from harness.oracle.checked_manager import CallOracles
from harness.oracle.kv_index import EventIndex
from harness.oracle.leaks import leak_problems
from harness.oracle.model import ReuseOracle
from harness.oracle.provenance import ProvenanceError
from harness.oracle.types import Event, OracleConfig, normalize_event

ORACLES = ("api", "refusal", "count", "provenance", "capacity", "events", "stats", "leaks",
           "integrity", "log", "eviction")
# eviction policies whose order the judge follows block by block (full attention, ids
# that name blocks): the model, built from the pool size and the block size
ORDER_MODELS: dict[str, Callable[[int, int], FreeQueue]] = {
    "lru-blocks-tail-first": lambda n, b: FreeQueue(n, b, uncached_first=False),
    "lru-blocks-tail-first-uncached-first": lambda n, b: FreeQueue(n, b, uncached_first=True)}
_EVERY_POSITION = 2**40  # a window wider than any context: positions as the events say
DEVICE = "GPU"  # the medium of the device pool's events (a host tier's is "CPU")


class Violation(NamedTuple):
    """One oracle's finding at op `step` (its index in the op list). `kind` names which
    of the oracle's checks failed (a short, stable phrase: "used blocks", "unfair
    refusal", "raised KeyError"), so a shrunk op list can be held to the same failure
    (`harness.conform.controller.fuzz.shrink`); `message` says it in full."""

    oracle: str
    step: int
    message: str
    kind: str = ""


def oracle_config(contract: Contract, num_blocks: int) -> OracleConfig:
    """The reuse oracle's config under `contract` for a pool of `num_blocks`."""
    bounded = contract.bounded_oracle
    return OracleConfig(contract.block_size, enable_partial_reuse=contract.partial_reuse,
                        copy_on_partial_reuse=contract.copy_on_partial_reuse,
                        reuse_alignment_blocks=(contract.state_interval or 1)
                        if contract.state_rule == "every-k" else 1,
                        max_num_blocks=num_blocks if bounded else None,
                        host_cache_blocks=(contract.host_blocks or 0) if bounded else 0,
                        unreused_tail=contract.unreused_tail)


def other_groups(contract: Contract) -> int:
    """How many groups beside the full-attention group the contract's layout has: a
    window group under "full-and-window", a state group under a step `state_rule`
    (vLLM's MambaSpec group; its events name it where they carry `group_idx`)."""
    window = contract.window is not None and contract.window_layout == "full-and-window"
    states = contract.state_interval is not None and contract.state_rule != "every-k"
    return int(window) + int(states)


def _fold_apart(held: Counter[tuple[str, Any]], event: dict[str, Any], holder: str) -> None:
    """Fold the BlockStored or BlockRemoved `event` into `held`, cached copies by
    (medium, hash) alone (`holder` names them). ValueError for the removal of a block
    `held` does not hold."""
    kind = event.get("type")
    medium = event.get("medium", DEVICE)
    for h in event.get("block_hashes", ()):
        key = (medium, h)
        if kind == "BlockStored":
            held[key] += 1
        elif kind == "BlockRemoved" and not held[key]:
            del held[key]
            raise ValueError(f"BlockRemoved names hash {h}, which {holder} does not hold "
                             f"on {medium}")
        elif kind == "BlockRemoved":
            held[key] -= 1
            if not held[key]:
                del held[key]


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class _EngineReports:
    """A `CacheOwner` view of one step report: the engine's own integrity and leak
    reports as they came back from wherever it runs (the leak check's input)."""

    def __init__(self, report: StepReport) -> None:
        self._report = report

    def check_integrity(self) -> None:
        """Raise AssertionError naming what the engine's integrity check found."""
        if self._report.integrity:
            raise AssertionError("; ".join(self._report.integrity))

    def leak_report(self) -> list[str]:
        """The engine's leak report (taken when nothing was live)."""
        return list(self._report.leaks or ())


class Judge:
    """The oracles for one fresh cache of `num_blocks` blocks (mutates only itself).

    An oracle that found something reports nothing more (its model no longer follows
    the cache, and the first finding is the one to read); `exact` says whether the count
    oracle's predictions are still exact. A model that cannot take an event of the log
    (an engine that raised half-way through an op, a log out of step with its calls) is
    a "log" finding, and its oracle stops there too: the judge never asks a model about
    a sequence the model does not hold, so nothing an engine does makes it raise.
    """

    def __init__(self, contract: Contract, num_blocks: int) -> None:
        B = contract.block_size
        self.contract = contract
        self.num_blocks = num_blocks
        self.reuse = ReuseOracle(oracle_config(contract, num_blocks))
        self.calls = CallOracles(B, num_blocks, block_reuse=True,
                                 sliding_window=_EVERY_POSITION)
        self.capacity = self.calls.capacity
        self.index = EventIndex(B)  # the full-attention group's events
        # each other group's cached blocks, by (medium, hash), where the events name their
        # group: folded apart and by hash alone (a state group's blocks span several of
        # the full group's, and its partial entries chain on the full group's hashes)
        self.groups: list[Counter[tuple[str, Any]]] = \
            [Counter() for _ in range(other_groups(contract))]
        # a host tier's cached blocks, by (medium, hash), where its events carry their
        # hashes alone (`Contract.host_events` "hashes-only"): no chain to place them on
        self.host: Counter[tuple[str, Any]] = Counter()
        self.exact = True
        model = ORDER_MODELS.get(contract.eviction_policy)
        # (a window or state group shares the pool: the full group's order is not alone;
        # a host tier serves what the device order evicted)
        self.order = model(num_blocks, B) if model is not None and contract.window is None \
            and contract.state_interval is None and contract.host_blocks is None \
            and contract.id_unit == "block" \
            and not contract.bounded_oracle else None
        self.window_group = WindowGroup(contract.window, B) \
            if contract.window is not None and contract.window_layout == "full-and-window" \
            else None
        self.states = StateGroup(contract.state_rule, contract.state_interval * B, B) \
            if contract.state_interval is not None and contract.state_rule != "every-k" \
            else None
        self.broken: set[str] = set()
        self.totals: Counter[str] = Counter()  # CounterMeaning -> value so far
        self.step = 0
        self._last: StepReport | None = None
        self._ids: dict[Hashable, list[int | None]] = {}  # live seq -> its block ids
        self._tokens: dict[Hashable, list[int]] = {}  # live seq -> its tokens
        # every prefix a sequence ever had, in any scope: what a stored chain may spell
        self._prefixes: set[tuple[int, ...]] = set()
        self._predicted: dict[Hashable, int] = {}  # live seq -> the reuse the oracle predicted
        self._preempted: set[Hashable] = set()  # preempted, not yet resumed
        # each sequence's prompt as first admitted (a resumption keeps it: `host_stores`
        # "prompt-only" stores no block past it), and its scope
        self._prompts: dict[Hashable, tuple[int, Any]] = {}
        # (scope, tokens) of each full block the host holds under `host_stores`
        # "prompt-only", while the count oracle is exact (no block left the device)
        self._hosted: set[tuple[Any, tuple[int, ...]]] = set()
        self._allocated = 0  # blocks the step's log says it allocated

    # -- one step ------------------------------------------------------------------------

    def observe(self, report: StepReport) -> list[Violation]:
        """Every oracle on one step; returns what they found (and remembers the state).
        Raises AssertionError only for a bug of the judge's own: its capacity model and
        its tracking of the live sequences disagree."""
        out: list[Violation] = []
        say = self._sayer(out)
        op = report.op
        if report.status == "raised":
            say("api", f"raised {report.detail.split(':', 1)[0]}",
                f"{op.describe()} raised {report.detail}")
        if report.status == "refused":
            self._refused(report, say)
        self._replay_log(report, say)
        self._fold_events(report, say)
        self._check_capacity(report, say)
        self._preempted.update(report.preempted)
        self._check_stats(report, say)
        if report.integrity:
            say("integrity", "broken invariant",
                f"after {op.describe()}: {'; '.join(report.integrity)}")
        if report.leaks is not None:
            problems = leak_problems([(self.contract.engine, _EngineReports(report))])
            if problems:
                say("leaks", "held with nothing live",
                    f"nothing is live, yet: {'; '.join(problems)}")
        self._last = report
        self.step += 1
        assert "capacity" in self.broken or self.capacity.live == self._ids.keys(), \
            f"the judge's capacity model holds {sorted(map(str, self.capacity.live))}, " \
            f"its own tracking {sorted(map(str, self._ids))}"
        return out

    def _sayer(self, out: list[Violation]) -> Any:
        def say(oracle: str, kind: str, message: str) -> None:
            if oracle not in self.broken:
                out.append(Violation(oracle, self.step, message, kind))
            self.broken.add(oracle)  # its model no longer follows the cache: report once
        return say

    # -- refusals --------------------------------------------------------------------------

    def _refused(self, r: StepReport, say: Any) -> None:
        op = r.op
        last = self._last
        changed = []
        removals = self.contract.refusal_evicts and all(
            e.get("type") == "BlockRemoved" for e in r.events)
        if r.log or (r.events and not removals):
            changed.append(f"it logged {list(r.log)} and published {list(r.events)}")
        before_used = last.used_blocks if last else 0
        before_cached = Counter(last.cached or ()) if last else Counter()
        if r.used_blocks != before_used:
            changed.append(f"used blocks {before_used} -> {r.used_blocks}")
        evicted = self._evicted_by(r) if self.contract.refusal_evicts else 0
        cached_now = Counter(r.cached or ())
        if cached_now != before_cached and not (evicted and cached_now <= before_cached):
            changed.append("the cached blocks changed")
        if last is not None:
            moved = {"cachedNumBlocks": -evicted, "freeNumBlocks": evicted}
            for side, now, was in (("engine", r.stats.engine, last.stats.engine),
                                   ("harness", r.stats.harness, last.stats.harness)):
                diff = {k: (was.get(k), v) for k, v in now.items() if was.get(k) != v
                        and not (side == "harness" and k in moved
                                 and v == (was.get(k) or 0) + moved[k])}
                if diff:
                    changed.append(f"{side} counters {diff}")
        if changed:
            say("refusal", "changed", f"{op.describe()} was refused but changed the cache: "
                           f"{'; '.join(changed)}")
        if "capacity" in self.broken:
            return  # its model stopped following the cache: it knows no need now
        need = self._need(op)
        if need is not None:
            # the duplicates a non-deduplicating engine keeps are not available either
            # (none where it deduplicates: there the engine's count is the oracle's)
            kept = max(0, r.used_blocks - self.capacity.needed)
            try:
                self.calls.capacity.check_refusal(need + kept, op.describe())
            except CapacityError as exc:
                say("capacity", "unfair refusal", str(exc))

    def _evicted_by(self, r: StepReport) -> int:
        """Cached blocks that left the cache in step `r` (cachedNumBlocks before - after;
        0 when either report lacks the gauge or it grew)."""
        last = self._last
        was = last.stats.harness.get("cachedNumBlocks") if last is not None else None
        now = r.stats.harness.get("cachedNumBlocks")
        return max(0, int(was) - int(now)) if was is not None and now is not None else 0

    def _need(self, op: Op) -> int | None:
        """Blocks `op` needs at least (None: not an allocation, or not known), asked of
        the capacity model while it follows the cache."""
        B = self.contract.block_size
        tail = self.contract.unreused_tail
        if self.window_group is not None or self.states is not None \
                or self.contract.window_pool is not None:
            return None  # what both groups (or pools) need is the engine's own: not judged
        if op.kind == "admit":
            scope = self.contract.scope_key(op.scope)
            # after an eviction the count oracle over-predicts hits: its probe only bounds
            # the match, so the most need over every match up to it is asked (no match is
            # not the most where a first chunk counts from the match's end)
            known = "count" not in self.broken
            cached = max(0, min(self.reuse.probe(op.tokens, scope) if known else len(op.tokens),
                                len(op.tokens) - max(tail, 1)))
            chunk = op.first_chunk if self.contract.chunked_allocation \
                and self.contract.admission_fits == "chunk" else None
            # an engine may keep blocks free beyond what its admission must fit
            reserve = self.contract.admission_reserve
            if self.contract.host_load_reserve == "inflight-prefills" \
                    and self._may_load_from_host(op.tokens, scope):
                reserve += self._inflight_reserve()
            return self.capacity.admission_need(op.tokens, scope, num_cached=cached,
                                                first_chunk=chunk, unreused_tail=tail,
                                                match_known=self.exact and known) \
                + reserve
        assert op.seq is not None or op.kind == "evict"
        if self.contract.allocates_ahead and op.kind in ("append", "reserve"):
            return None  # the engine asked for more than the tokens need
        if op.kind == "append" and op.seq in self.capacity.live:
            return self.capacity.append_need(op.seq, len(op.tokens))
        if op.kind == "reserve" and op.seq in self._ids:
            assert op.num_tokens is not None
            want = _blocks(min(op.num_tokens, len(self._tokens[op.seq])), B)
            return max(0, want - len(self._ids[op.seq]))
        return None

    def _whole_prompt_cached(self, tokens: Sequence[int], scope: Any) -> bool:
        """Whether the count oracle holds every block of `tokens` computed in `scope`
        (the last token too: `unreused_tail` more tokens past them; changes nothing)."""
        probe = [*tokens, *[0] * self.contract.unreused_tail]
        return self.reuse.probe(probe, scope) >= len(tokens)

    def _may_load_from_host(self, tokens: Sequence[int], scope: Any) -> bool:
        """Whether an admission of `tokens` in `scope` may load blocks from the host
        tier. While the count oracle is exact no block has left the device, whose hit
        stops at the last token: the host loads only the last block of a prompt cached
        whole, where it holds that block (`_host_holds`). Past that (or with the count
        oracle stopped) any admission may."""
        if self.contract.host_blocks is None:
            return False
        if not self.exact or "count" in self.broken:
            return True
        return self._whole_prompt_cached(tokens, scope) and self._host_holds(tokens, scope)

    def _host_holds(self, tokens: Sequence[int], scope: Any) -> bool:
        """Whether the host tier holds the block ending at the last of `tokens` (a
        prompt the count oracle holds whole), under the contract's `host_stores`:
        "when-computed", every computed block; "prompt-only", a block within the prompt
        some sequence was first admitted with, once that sequence computed or hit it
        (`_store`); "on-eviction", none while no block has left the device. Once one
        has (the count oracle's prediction an upper bound), any block may be there."""
        rule = self.contract.host_stores
        if not self.exact or rule == "when-computed":
            return True
        return rule == "prompt-only" and (scope, tuple(tokens)) in self._hosted

    def _store(self, seq: Hashable, computed: int) -> None:
        """Under `host_stores` "prompt-only", the host holds `seq`'s full blocks within
        its first prompt up to `computed` tokens (computed or hit)."""
        if self.contract.host_stores != "prompt-only" or seq not in self._tokens:
            return
        B = self.contract.block_size
        prompt, scope = self._prompts[seq]
        tokens = self._tokens[seq]
        self._hosted.update((scope, tuple(tokens[:n]))
                            for n in range(B, min(computed, prompt) + 1, B))

    def _inflight_reserve(self) -> int:
        """The blocks the live sequences still need to hold all their tokens: what the
        prefills in flight (a prompt scheduled in part) keep free from a host load
        (`Contract.host_load_reserve`). A decoding sequence holds a block for each of
        its tokens, so it adds none."""
        B = self.contract.block_size
        return sum(max(0, _blocks(len(self._tokens[seq]), B) - len(ids))
                   for seq, ids in self._ids.items())

    # -- the event log: count, provenance, capacity ----------------------------------------

    def _replay_log(self, r: StepReport, say: Any) -> None:
        admits = 0
        events: list[Event] = []
        tree_events: list[Event] = []  # as the capacity model counts them (`_in_tree`)
        B = self.contract.block_size
        self._allocated = sum(len(ev.get("block_ids") or ()) - (ev.get("num_tokens", 0) // B
                                                                if ev.get("kind") == "admit"
                                                                else 0)
                              for ev in r.log if ev.get("kind") in ("admit", "append"))
        for raw in r.log:
            try:
                ev = normalize_event(raw)
            except ValueError as exc:
                say("log", "malformed", f"the adapter logged {raw!r}: {exc}")
                continue
            events.append(ev)
            if ev.kind == "admit":
                admits += 1
                self._admitted(r, ev, say)
            elif ev.kind != "commit" or ev.num_tokens >= self._predicted.get(ev.seq_id, 0):
                # after an eviction the oracle may have predicted more reuse than the
                # engine found: it holds those tokens computed already, so a commit
                # below them tells it nothing
                self._feed("count", "", say, self.reuse.apply, ev)
            self._track(ev)
            self._follow_order(ev, say)
            if self.window_group is not None:
                self.window_group.apply(ev)
            if self.states is not None:
                self.states.apply(ev)
            tree_events.append(self._in_tree(ev))
        if self.order is not None and r.op.kind == "evict" and r.status == "done" \
                and "eviction" not in self.broken:
            self._forget(self.order.evict(r.op, int(r.value)), say)
        wanted = 1 if r.op.kind == "admit" and r.status == "done" else 0
        if admits != wanted:
            say("log", "admissions", f"{r.op.describe()} ({r.status}) logged {admits} "
                                     "admissions")
        where = r.op.describe()
        self._feed("provenance", "foreign KV", say,
                   lambda evs: self.calls.provenance(evs, []), events)
        # a deduplicating engine's count is exact; otherwise `_check_capacity` bounds it
        used = self._held(r) if self.contract.dedup_on_commit else None
        self._feed("capacity", "used blocks", say,
                   lambda evs: self.calls.capacity_after(where, evs, used), tree_events)

    def _in_tree(self, ev: Event) -> Event:
        """`ev` as the capacity model counts it: under "extend-end" a commit puts in the
        tree only the tokens up to the sequence's deepest kept state (`StateGroup.cached`),
        so its blocks past them stay its own, never shared; under every other rule a
        commit's valid tokens are all cached."""
        if ev.kind != "commit" or self.states is None or self.states.rule != "extend-end":
            return ev
        cached = self.states.cached(ev.seq_id)
        return ev if cached is None else ev._replace(num_tokens=cached)

    def _follow_order(self, ev: Any, say: Any) -> None:
        """The contract's eviction order over one log event: the blocks an allocation
        takes are those the policy names, and the count oracle forgets what they held."""
        if self.order is None or "eviction" in self.broken:
            return
        step = self.order.apply(ev)
        if step.problem is not None:
            say("eviction", "order", step.problem)
            self.exact = False  # the count oracle no longer learns what left the cache
            return
        self._forget(step.evicted, say)

    def _forget(self, keys: Any, say: Any) -> None:
        """Tell the count oracle which blocks left the cache (its model no longer
        follows an engine it found wrong: then nothing)."""
        if "count" in self.broken:
            return
        for scope, tokens in keys:
            try:
                self.reuse.forget(scope, tokens)
            except ValueError as exc:  # the engine gave away a block it still serves
                say("eviction", "served evicted", f"the eviction order took a block the "
                                                  f"count oracle holds for a live sequence "
                                                  f"({exc})")
                self.exact = False
                return

    def _feed(self, oracle: str, kind: str, say: Any, apply: Any, ev: Any) -> Any:
        """`apply(ev)` on `oracle`'s model unless it stopped; its finding is said as
        `kind`. A model that cannot take `ev` is a "log" finding, and stops: it holds
        part of the event at most, and follows the cache no more."""
        if oracle in self.broken:
            return None
        try:
            return apply(ev)
        except (ProvenanceError, CapacityError) as exc:
            say(oracle, kind, str(exc))
        except ValueError as exc:  # the log does not replay: the adapter's or the engine's
            say("log", "does not replay", f"{oracle} oracle cannot replay {ev}: {exc}")
            self.broken.add(oracle)
        return None

    def _admitted(self, r: StepReport, ev: Any, say: Any) -> None:
        B = self.contract.block_size
        got, prompt = ev.num_tokens, len(ev.tokens)
        which = "resumed" if ev.seq_id in self._preempted else "new"
        self._preempted.discard(ev.seq_id)
        if which == "new" or ev.seq_id not in self._prompts:
            self._prompts[ev.seq_id] = (prompt, ev.scope)
        # under host_full_hit "all-but-last" a reuse of all but the last token, not whole
        # blocks, is a prompt cached whole whose last block the host loaded: the engine
        # counts the loaded tokens, the whole prompt, as hits
        rule = self.contract.host_full_hit == "all-but-last" \
            and self.contract.host_blocks is not None
        loaded_whole = rule and got == prompt - 1 and got % B != 0
        counted = prompt if loaded_whole else got
        self.totals.update({"requests": 1, "prompt_tokens": prompt, "reused_tokens": counted,
                            "reused_blocks": _blocks(counted, B),
                            "missed_blocks": _blocks(prompt, B) - _blocks(counted, B),
                            f"{which}_requests": 1, f"{which}_prompt_tokens": prompt,
                            f"{which}_reused_tokens": counted})
        if isinstance(r.value, dict) and r.value.get("reused_tokens") != got:
            say("log", "returned other", f"{r.op.describe()} returned {r.value} but logged "
                                         f"{got} reused tokens")
        what = f"{r.op.describe()} reused {got} tokens"
        limit = max(0, prompt - self.contract.unreused_tail)
        if got > limit:
            say("count", "tail", f"{what}: the last {self.contract.unreused_tail} prompt "
                                 f"token(s) are never reused (at most {limit})")
        # a prompt cached whole, its last block on the host, reuses all but its last
        # token where the contract says so (`Contract.host_full_hit`)
        whole = rule and "count" not in self.broken \
            and self._whole_prompt_cached(ev.tokens, ev.scope)
        if not self.contract.partial_reuse and got % B and not loaded_whole:
            say("count", "partial", f"{what}: not whole blocks of {B}, which the contract "
                                    "promises")
        pred = self._feed("count", "", say, self.reuse.apply, ev)
        if pred is None:
            return
        want = self._predicted[ev.seq_id] = pred.reused_tokens
        why = ""
        if whole and self._host_holds(ev.tokens, ev.scope):
            # its last block loaded from the host, its last token computed again; where
            # the host does not hold that block (vLLM stores no block past a request's
            # prompt: `host_stores` "prompt-only"), the device's hit, `want`, stands
            want = prompt - 1
        if self.states is not None:
            full, want = want, self.states.cut(ev.tokens, ev.scope, want)
            self.states.matched(ev.seq_id, full, want)
            why = (f" (its full-attention match cut to the last recurrent state kept at a "
                   f"step's end, {self.contract.state_rule})")
        if self.exact and got != want and not self._window_gap_allows(got, want):
            say("count", "reuse", f"{what}; the count oracle predicts {want}{why}")
        elif not self.exact and got > want:
            say("count", "reuse", f"{what}, more than was ever computed in its scope "
                                  f"({want}; blocks were evicted since, so that is an "
                                  "upper bound)")

    def _window_gap_allows(self, got: int, want: int) -> bool:
        """Whether a match of `got` tokens where the count oracle predicts `want` is one
        a smaller window pool's tombstones explain (`Contract.window_pool`): shorter, on a
        block boundary, with tokens in the tree lacking window KV before the admission
        (the last report's windowGapTokens)."""
        if self.contract.window_pool is None or self._last is None:
            return False
        gap = self._last.stats.harness.get("windowGapTokens", 0)
        return got < want and got % self.contract.block_size == 0 and int(gap) > 0

    def _track(self, ev: Any) -> None:
        sid = ev.seq_id
        if ev.kind == "admit":
            self._ids[sid] = list(ev.block_ids)
            self._tokens[sid] = list(ev.tokens)
            self._spelled(self._tokens[sid], 0)
            self._store(sid, ev.num_tokens)
        elif ev.kind == "append" and sid in self._ids:
            self._ids[sid] += list(ev.block_ids)
            self._tokens[sid] += ev.tokens
            self._spelled(self._tokens[sid], len(self._tokens[sid]) - len(ev.tokens))
        elif ev.kind == "commit" and ev.block_ids and sid in self._ids:
            self._ids[sid] = list(ev.block_ids)
        if ev.kind == "commit":
            self._store(sid, ev.num_tokens)
        elif ev.kind == "free":
            self._ids.pop(sid, None)
            self._tokens.pop(sid, None)
            self._predicted.pop(sid, None)

    def _spelled(self, tokens: list[int], start: int) -> None:
        """Remember the prefixes of `tokens` longer than `start` tokens."""
        self._prefixes.update(tuple(tokens[:n]) for n in range(start + 1, len(tokens) + 1))

    def _held(self, r: StepReport) -> int:
        """Blocks the live sequences hold for their tokens' positions: the engine's used
        blocks less those an allocating-ahead engine holds beyond them (its
        aheadNumBlocks gauge) and those of a hybrid cache's window group
        (windowNumBlocks) and state group (stateNumBlocks)."""
        ahead = r.stats.harness.get("aheadNumBlocks", 0) if self.contract.allocates_ahead \
            else 0
        window = r.stats.harness.get("windowNumBlocks", 0) if self.window_group else 0
        states = r.stats.harness.get("stateNumBlocks", 0) if self.states else 0
        return r.used_blocks - int(ahead) - int(window) - int(states)

    def _check_capacity(self, r: StepReport, say: Any) -> None:
        if "capacity" in self.broken:
            return
        if self.window_group is not None:
            want, got = self.window_group.held(), r.stats.harness.get("windowNumBlocks")
            if got != want:
                say("capacity", "window blocks", f"after {r.op.describe()}: the window "
                                                 f"group holds {got} "
                                f"blocks (windowNumBlocks); its live sequences need {want} "
                                f"(window {self.contract.window}: the blocks before "
                                "computed - window + 1 are freed at each allocation)")
                return
        where = r.op.describe()
        if self.contract.dedup_on_commit:
            return  # checked exactly with the events (`_replay_log`)
        distinct = len({b for ids in self._ids.values() for b in ids if b is not None})
        held = self._held(r)
        if not self.capacity.needed <= held == distinct:
            ahead = f" ({r.used_blocks - held} more held ahead)" if held != r.used_blocks \
                else ""
            say("capacity", "used blocks", f"after {where}: the engine counts {held} used "
                                           f"blocks{ahead}; "
                            f"its live sequences were given {distinct} distinct blocks and "
                            f"need at least {self.capacity.needed}")

    # -- router events ---------------------------------------------------------------------

    def _order_known(self) -> bool:
        """Whether the count oracle learns every eviction from the contract's order."""
        return self.order is not None and "eviction" not in self.broken

    def _fold_events(self, r: StepReport, say: Any) -> None:
        if "events" in self.broken:
            return
        if not self.contract.events:
            if r.events:
                say("events", "published", f"{r.op.describe()} published "
                                           f"{list(r.events)[:2]}, but the "
                              "contract says the engine publishes no events")
            elif self._evicted_by(r) and not self.contract.bounded_oracle \
                    and not self._order_known():
                self.exact = False  # blocks left the cache; the count oracle keeps them
            return
        # by (medium, hash): a block offloaded to a host tier is removed from the device
        # and stored on the host in one op, which is a move, not churn
        before = self._keys()
        removed: Counter[Any] = Counter()
        stored: Counter[Any] = Counter()
        window_stores: list[dict[str, Any]] = []  # placed once the full group's are folded
        gone: list[tuple[int, ...]] = []  # the device blocks the events removed, by tokens
        for event in r.events:
            kind = event.get("type")
            dropped = kind == "BlockRemoved" or (kind == "AllBlocksCleared" and (
                bool(self.index.cached()) or bool(self.host)))
            if dropped and not self.contract.bounded_oracle and not self._order_known():
                learnt = self._removed_tokens(event)
                if learnt is None:
                    self.exact = False  # the count oracle's model keeps every block
                else:
                    gone += learnt
            group = self._group(event)
            if group is None:
                say("events", "group", f"after {r.op.describe()}: event {event} names group "
                                       f"{event.get('group_idx')!r}; the contract's layout "
                                       f"has {1 + len(self.groups)} groups")
                return
            medium = event.get("medium", DEVICE)
            if kind == "BlockRemoved":
                removed.update((medium, h) for h in event.get("block_hashes", ()))
            elif kind == "BlockStored":
                stored.update((medium, h) for h in event.get("block_hashes", ()))
                apart = self._hashes_only(event)  # nothing to place it by
                misplaced = self._misplaced(event) if group == 0 and not apart else ""
                if misplaced:
                    say("events", "parent", f"after {r.op.describe()}: {misplaced}")
                    return
                if group == 1 and self.window_group is not None and not apart:
                    window_stores.append(event)
            try:
                self._apply(group, event)
            except (ValueError, KeyError, TypeError) as exc:
                say("events", "does not fold", f"after {r.op.describe()}: event {event} does "
                                               f"not fold: {exc}")
                return
        for event in window_stores:
            misplaced = self._misplaced(event)
            if misplaced:
                say("events", "parent", f"after {r.op.describe()}: the window group's "
                                        f"{misplaced}")
                return
        self._learn_evictions(gone)
        after_keys = self._keys()
        # a block whose every copy the step removed, then stored again: gone in between
        # (a cache that keeps copies, a hybrid's groups or duplicates, may drop one copy
        # and store another while the block stays cached throughout); and more of them
        # than the step allocated blocks (an allocation may evict the cached copies of
        # blocks it then computes again: gone, then computed). By (medium, hash), over
        # every group: a move between tiers is no churn
        churn = sorted(key[1] for key in removed if key in stored
                       and after_keys[key] >= before[key] > 0 and removed[key] >= before[key])
        if len(churn) <= self._allocated:
            churn = []
        after: Counter[Any] = self.index.cached(DEVICE)  # what the device holds, in
        for group_blocks in self.groups:                   # every group
            after.update({h: n for (medium, h), n in group_blocks.items()
                          if medium == DEVICE})
        if churn:
            say("events", "churn", f"{r.op.describe()} published BlockRemoved and "
                                   "BlockStored again "
                          f"for blocks it kept cached ({churn[:4]}): a router folding in "
                          "between sees the prefix gone")
        if r.cached is None:  # the engine names no hashes: compare how many
            count = r.stats.harness.get("cachedNumBlocks")
            if count is not None and count != sum(after.values()):
                say("events", "cached count", f"after {r.op.describe()} the events say "
                              f"{sum(after.values())} blocks are cached, the cache holds "
                              f"{count} (cachedNumBlocks)")
            return
        held = Counter(r.cached)
        if after != held:
            missing, extra = held - after, after - held
            say("events", "cached blocks", f"after {r.op.describe()} the events say "
                                           f"{sum(after.values())} "
                          f"blocks are cached, the cache holds {sum(held.values())}: "
                          f"{len(missing)} never published ({sorted(missing)[:3]}), "
                          f"{len(extra)} published but gone ({sorted(extra)[:3]})")

    def _group(self, event: dict[str, Any]) -> int | None:
        """The group `event` belongs to: the one it names where the contract says events
        name their group (`group_idx`), else the full-attention group (0). None for a
        group the contract's layout does not have."""
        group = event.get("group_idx") if "group_idx" in self.contract.event_fields else 0
        group = 0 if group is None else group
        return group if isinstance(group, int) and 0 <= group <= len(self.groups) else None

    def _hashes_only(self, event: dict[str, Any]) -> bool:
        """Whether `event` is a host tier's BlockStored or BlockRemoved (a medium other
        than the device's) that carries its hashes alone (`Contract.host_events`
        "hashes-only"): folded by (medium, hash) into `host`, not placed on a chain."""
        return self.contract.host_events == "hashes-only" \
            and event.get("type") in ("BlockStored", "BlockRemoved") \
            and event.get("medium", DEVICE) != DEVICE

    def _apply(self, group: int, event: dict[str, Any]) -> None:
        """Fold `event` into its group's blocks, or a host tier's whose events carry
        their hashes alone into `host` (AllBlocksCleared: every group's and the host's).
        ValueError for the removal of a block the group (or host) does not hold."""
        kind = event.get("type")
        if self._hashes_only(event):
            _fold_apart(self.host, event, "the host tier")
            return
        if group == 0 or kind == "AllBlocksCleared":
            self.index.apply(event)
        if kind == "AllBlocksCleared":
            for held in self.groups:
                held.clear()
            self.host.clear()
        if group != 0:
            _fold_apart(self.groups[group - 1], event, f"group {group}")

    def _keys(self) -> Counter[tuple[str, Any]]:
        """The cached copies of each block, every group's and the host's folded apart,
        by (medium, hash)."""
        out: Counter[tuple[str, Any]] = Counter(self.index.counts)
        for held in (*self.groups, self.host):
            out.update(held)
        return out

    def _removed_tokens(self, event: dict[str, Any]) -> list[tuple[int, ...]] | None:
        """The tokens from the root to the end of each block a device BlockRemoved of the
        full-attention group names (read up the events' chains before it is folded), for
        the count oracle to forget: where the contract has one device group alone (no
        window, Mamba or host tier, whose evictions the count oracle models apart).
        None where that cannot be told (another event, group or medium, a contract with
        more, a chain the events do not spell)."""
        c = self.contract
        if event.get("type") != "BlockRemoved" or self._group(event) != 0 \
                or event.get("medium", DEVICE) != DEVICE or c.window is not None \
                or c.state_interval is not None or c.host_blocks is not None \
                or "count" in self.broken:
            return None
        out = []
        for h in event.get("block_hashes", ()):
            tokens = self.index.chain_tokens(h)
            if tokens is None:
                return None
            out.append(tokens)
        return out

    def _learn_evictions(self, gone: list[tuple[int, ...]]) -> None:
        """The count oracle forgets each block the events removed from the device
        (`_removed_tokens`), so its prediction stays exact after an eviction it has no
        order model of; where the block's scope is not one (two scopes cached the same
        tokens) or a live sequence holds it in the model, it falls back to an upper
        bound (which block the engine dropped is then not known; a live sequence's
        block gone is the integrity and provenance oracles' to judge)."""
        for tokens in gone:
            if not self.exact:
                return
            scopes = self.reuse.scopes_caching(tokens)
            if len(scopes) > 1:
                self.exact = False
                return
            if scopes:
                try:
                    self.reuse.forget(scopes[0], tokens)
                except ValueError:
                    self.exact = False
                    return

    def _misplaced(self, event: dict[str, Any]) -> str:
        """Why the BlockStored `event` is not stored under the block right before it (""
        when it is): its parent must be cached in the full-attention group, and the
        parent's chain followed by the stored tokens must spell a prefix some sequence
        had (a parent that is an earlier block of the chain, or none where one was due,
        spells nothing). A window group's blocks are the full group's, by the same
        hashes: its stores are placed on the full group's chain once the step's full
        stores are folded (a state group's span several blocks: not placed)."""
        parent = event.get("parent_block_hash")
        hashes = list(event.get("block_hashes", ()))[:2]
        above = () if parent is None else self.index.chain_tokens(parent)
        if above is None:
            return (f"BlockStored {hashes} names parent {parent}, which is not cached (or "
                    "a block above it is not): a router cannot place the blocks")
        tokens = tuple(event.get("token_ids", ()))
        if above + tokens in self._prefixes:
            return ""
        return (f"BlockStored {hashes} under parent {parent}: its {len(above)} tokens, then "
                f"the {len(tokens)} stored, are no prefix of any sequence's tokens: the "
                "parent is not the block right before them")

    # -- counters --------------------------------------------------------------------------

    def expected(self, meaning: CounterMeaning) -> int:
        """What a counter of `meaning` must read now."""
        return 0 if meaning == "zero" else self.totals[meaning]

    def _check_stats(self, r: StepReport, say: Any) -> None:
        engine = r.stats.engine
        for counter, meaning in self.contract.counters:
            if counter not in engine:
                say("stats", "missing counter", f"the engine exposes no counter {counter!r} "
                                                f"(it has {sorted(engine)})")
                continue
            want = self.expected(meaning)
            if engine[counter] != want:
                say("stats", "counter", f"after {r.op.describe()}: {counter} = "
                                    f"{engine[counter]}, but "
                             f"the admissions add up to {want} ({meaning})")
        harness = r.stats.harness
        cached = None if r.cached is None else len(r.cached)
        gauges: tuple[tuple[str, int | None, str], ...] = (
            ("usedNumBlocks", r.used_blocks, "blocks live sequences hold"),
            ("cachedNumBlocks", cached, "blocks the cache holds"),
            ("maxNumBlocks", self.num_blocks, "the pool"))
        for name, gauge, what in gauges:
            if name in harness and gauge is not None and harness[name] != gauge:
                say("stats", "gauge", f"after {r.op.describe()}: {name} = {harness[name]}, but "
                             f"{what}: {gauge}")

"""A seeded differential fuzz over the protocol, and shrinking a failure to a short op list.

`fuzz` drives a fresh cache with ops drawn from `random.Random(seed)`: admissions of
prompts built from a few shared prefixes (so blocks, branches and partial blocks are
shared), in a handful of scopes chosen to collide (a salt or a caller extra key equal to
a LoRA id, LoRA adapters sharing a name or an id), chunked admissions, commits of any
length up to what is scheduled, decode appends, frees and evictions, in a small pool so
that admissions evict and are refused. Where the contract has a preemption path, half
the seeds also preempt live sequences and resume preempted ones (an admit of the id with
its tokens and scope so far), and where the adapter honours `CacheOptions` a seed may
open its cache with some (a scheduler's token budget and long-prefill threshold, a
sliding window); caller extra keys, preemptions and options are each drawn from a stream
of their own, so the ops of a seed without them stay as they were. Each op is chosen
from the results so far (only live sequences are committed or freed), and every step is
judged against the oracles: the engine is differenced against the harness's independent
models. At the end everything is freed (the leak check).

`shrink` cuts a failing op list down to one that still fails the same way: its first
violation is the original's, the same oracle's same check (`Violation.kind`) at an op of
the same kind. It removes ops (ddmin), simplifies each (admissions: no chunk, no scope,
shorter prompts; appends: one token; evictions: one block), shrinks the pool (so ops
whose only job was to fill it go too) and renames the tokens 1, 2, 3, ... in order of
first use (equal tokens stay equal). Ops are data and a sub-list replays (`Session`
skips ops no longer valid).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from harness.conform import ops
from harness.conform.controller.families import B
from harness.conform.controller.judge import Judge, Violation
from harness.conform.controller.targets import Target, replay
from harness.conform.ops import Op
from harness.conform.protocol import CacheOptions, Contract, Scope, lora_id_text

FUZZ_SCOPES: tuple[Scope | None, ...] = (
    None, None, None, Scope(salt="x"), Scope(salt=lora_id_text(1)), Scope.lora("x", 1),
    Scope.lora("x", 2), Scope.lora("y", 1))
# caller extra keys, given to some admissions of the default scope by a generator of their
# own, so an engine whose key takes none sees the ops it saw before they were added
EXTRA_KEYS = (lora_id_text(1), "x", "x" + lora_id_text(1))
EXTRA_KEY_SHARE = 0.4
POOL_SIZES = (8, 12, 16, 24)
DEFAULT_OPS = 80
SHRINK_BUDGET = 400  # replays at most, per failure


@dataclass(frozen=True)
class FuzzOutcome:
    """One seed's run: its pool, its ops, the first violation (None: it passed), the
    options its cache was opened with and the contract it ran under."""

    seed: int
    num_blocks: int
    ops: tuple[Op, ...]
    violation: Violation | None
    options: CacheOptions = field(default_factory=CacheOptions)
    contract: Contract | None = None


@dataclass
class _Live:
    tokens: list[int]
    scope: Scope | None
    scheduled: int
    committed: int

    @property
    def length(self) -> int:
        return len(self.tokens)


class _Draw:
    """Chooses the next op from the live sequences (mutated by `record`). Under a
    contract whose appends are decode steps (`Contract.decode_steps`) it appends one
    token to a fully computed sequence only."""

    def __init__(self, seed: int) -> None:
        self.decode_steps = False  # set from the contract once the cache is open
        self.preempts = False  # likewise: whether the contract has a preemption path
        self.rng = random.Random(seed)
        r = self.rng
        self.prefixes = [[r.randrange(1, 40) for _ in range(r.randrange(4, 20))]
                         for _ in range(3)]
        self.keys = random.Random(f"extra-key-{seed}")
        self.live: dict[str, _Live] = {}
        self.preempted: dict[str, _Live] = {}  # seq -> its tokens and scope, to resume
        self.count = 0

    def next(self) -> Op:
        r = self.rng
        kinds = ["admit"] * 6 + ["commit"] * 6 + ["free"] * 4 + ["append"] * 3 + \
            ["reserve"] * 2 + ["evict"] + (["preempt"] * 2 if self.preempts else [])
        kind = r.choice(kinds if self.live else ["admit"])
        if kind == "admit" or not self.live:
            if self.preempted and r.random() < 0.5:
                seq = r.choice(sorted(self.preempted))
                return ops.admit(seq, self.preempted[seq].tokens, self.preempted[seq].scope)
            return self._admit()
        if kind == "evict":
            return ops.evict(r.randrange(1, 4))
        seq = r.choice(sorted(self.live))
        s = self.live[seq]
        if kind == "commit":
            return ops.commit(seq, r.randint(s.committed, s.scheduled))
        if kind == "reserve" and s.scheduled < s.length:
            return ops.reserve(seq, r.randint(s.scheduled + 1, s.length))
        if kind == "append" and self.decode_steps and s.committed == s.length:
            return ops.append(seq, [r.randrange(1, 40)])
        if kind == "append" and s.scheduled == s.length and not self.decode_steps:
            return ops.append(seq, [r.randrange(1, 40) for _ in range(r.randint(1, 3))])
        if kind == "preempt":
            return ops.preempt(seq)
        return ops.free(seq)

    def _admit(self) -> Op:
        r = self.rng
        self.count += 1
        prefix = r.choice(self.prefixes)
        cut = r.randint(0, len(prefix))
        tokens = prefix[:cut] + [r.randrange(1, 40) for _ in range(r.randint(1, 10))]
        chunk = r.randint(1, len(tokens)) if r.random() < 0.25 else None
        scope = r.choice(FUZZ_SCOPES)
        if scope is None and self.keys.random() < EXTRA_KEY_SHARE:
            scope = Scope(extra_key=self.keys.choice(EXTRA_KEYS))
        return ops.admit(f"s{self.count}", tokens, scope, chunk)

    def record(self, op: Op, status: str, value: object, preempted: tuple[str, ...]) -> None:
        """What `op` did, as the step report says (`preempted`: the sequences it
        preempted, which leave the live ones to be resumed)."""
        for seq in preempted:
            live = self.live.pop(seq, None)
            if live is not None:
                self.preempted[seq] = live
        if status != "done" or op.seq is None or op.kind == "preempt":
            return
        if op.seq in preempted:  # the scheduler preempted it in its own step
            if op.kind == "append":
                self.preempted[op.seq].tokens += op.tokens
            return
        if op.kind == "admit":
            assert isinstance(value, dict)
            self.preempted.pop(op.seq, None)
            self.live[op.seq] = _Live(list(op.tokens), op.scope, value["scheduled_tokens"],
                                      value["reused_tokens"])
        elif op.kind == "free":
            del self.live[op.seq]
        elif op.kind == "commit":
            assert op.num_tokens is not None
            self.live[op.seq].committed = op.num_tokens
        elif op.kind == "reserve":
            assert isinstance(value, int)
            self.live[op.seq].scheduled = value
        elif op.kind == "append":
            s = self.live[op.seq]
            s.tokens += op.tokens
            s.scheduled = s.length


def fuzz_options(seed: int, honoured: Callable[[CacheOptions], tuple[str, ...]],
                 num_blocks: int) -> CacheOptions:
    """The options seed `seed` opens its cache of `num_blocks` with, among those
    honoured (`honoured(chosen)`: what a cache opened with the options `chosen` so far
    honours beside them, its contract's `options`): none for half the seeds, else each
    honoured one with an even chance, small enough to bite (from a stream of their own:
    the seed's ops do not move). A host tier holds two or three times the device pool
    (what the oracle's two-tier model is exact for, harness.oracle.tiers); a recurrent
    state is kept every 1 to 3 blocks; those two come from a stream of their own too.
    Every option is kept only where the cache opened with the options drawn before it
    honours it (an adapter may open two options only apart: SGLang 0.5.18's window is
    the tree adapter's, its chunk budget the scheduler code's). With a window, half the
    caches that honour it get a window pool smaller than the full one, from a stream of
    its own too: from the smallest SGLang's server takes (more than the window and a
    page) to a block short of the full pool."""
    r = random.Random(f"options-{seed}")
    first = honoured(CacheOptions())
    if not first or r.random() < 0.5:
        return CacheOptions()
    picks = {"window": r.randrange(2, 4 * B), "chunk_budget": r.randrange(1, 4 * B),
             "long_prefill_threshold": r.randrange(1, 3 * B)}
    chosen: dict[str, int] = {}
    for k, v in picks.items():  # each drawn as before, kept where the others drawn allow it
        if k in first and r.random() < 0.5 and k in honoured(CacheOptions(**chosen)):
            chosen[k] = v
    layout = random.Random(f"layout-{seed}")
    layouts = {"host_blocks": layout.randint(2, 3) * num_blocks,
               "state_interval": layout.randint(1, 3)}
    for k, v in layouts.items():
        if k in honoured(CacheOptions(**chosen)) and layout.random() < 0.5:
            chosen[k] = v
    window = chosen.get("window")
    pool = random.Random(f"window-pool-{seed}")
    smallest = (window + B) // B + 1 if window is not None else num_blocks
    if window is not None and smallest < num_blocks \
            and "window_pool" in honoured(CacheOptions(**chosen)) and pool.random() < 0.5:
        chosen["window_pool"] = pool.randint(smallest, num_blocks - 1)
    return CacheOptions(**chosen)


def fuzz(target: Target, seed: int, num_ops: int = DEFAULT_OPS) -> FuzzOutcome:
    """Run seed `seed` (stops at the first violation); see the module docstring."""
    draw = _Draw(seed)
    num_blocks = draw.rng.choice(POOL_SIZES)
    options = fuzz_options(seed, lambda chosen: target.open(num_blocks, B, chosen).options,
                           num_blocks)
    contract = target.open(num_blocks, B, options)
    draw.decode_steps = contract.decode_steps
    # half the seeds preempt, where the contract can: the others draw as they always did
    draw.preempts = contract.preemption != "none" and \
        random.Random(f"preempt-{seed}").random() < 0.5
    judge = Judge(contract, num_blocks)
    done: list[Op] = []

    def step(op: Op) -> Violation | None:
        report = target.apply(op)
        done.append(op)
        draw.record(op, report.status, report.value, report.preempted)
        found = judge.observe(report)
        return found[0] if found else None

    for _ in range(num_ops):
        found = step(draw.next())
        if found is not None:
            return FuzzOutcome(seed, num_blocks, tuple(done), found, options, contract)
    for seq in sorted(draw.live):
        found = step(ops.free(seq))
        if found is not None:
            return FuzzOutcome(seed, num_blocks, tuple(done), found, options, contract)
    return FuzzOutcome(seed, num_blocks, tuple(done), None, options, contract)


class Shrunk(NamedTuple):
    """A shrunk failure: its op list, on a fresh cache of `num_blocks` blocks."""

    ops: list[Op]
    num_blocks: int


def shrink(target: Target, op_list: list[Op], num_blocks: int, first: Violation,
           budget: int = SHRINK_BUDGET, options: CacheOptions | None = None) -> Shrunk:
    """A shorter op list, on a pool no larger, whose first violation is `first`'s (the
    first violation of `op_list` on `num_blocks` blocks, a cache opened with `options`,
    never below its window pool): the same oracle, the same kind, at an op of the same kind. `op_list` itself when
    nothing smaller does. At most `budget` replays; changes nothing but the target's
    open cache."""
    left = [budget]
    wanted = (first.oracle, first.kind, op_list[first.step].kind)

    def fails(candidate: list[Op], pool: int) -> bool:
        if left[0] <= 0 or not candidate:
            return False
        left[0] -= 1
        found = replay(target, candidate, pool, B, options)
        return bool(found) and \
            (found[0].oracle, found[0].kind, candidate[found[0].step].kind) == wanted

    def on(pool: int) -> Callable[[list[Op]], bool]:
        return lambda candidate: fails(candidate, pool)

    pool = num_blocks
    # a window pool no larger than the full one (`CacheOptions.window_pool`) bounds it
    least = max(1, options.window_pool or 1) if options is not None else 1
    current = _ddmin(list(op_list), on(pool))
    while True:  # a smaller pool lets prompts shrink, and shorter prompts fit smaller pools
        before = (current, pool)
        current = _simplify(current, on(pool))
        while pool // 2 >= least and fails(current, pool // 2):  # halve, then one by one
            pool //= 2
        while pool > least and fails(current, pool - 1):
            pool -= 1
        current = _ddmin(current, on(pool))
        if (current, pool) == before:
            break
    renamed = _renamed(current)
    if fails(renamed, pool):
        current = renamed
    return Shrunk(current, pool)


def _simplify(current: list[Op], fails: Callable[[list[Op]], bool]) -> list[Op]:
    """Each op replaced by its first simpler variant that still fails, until none does."""
    changed = True
    while changed:
        changed = False
        for i in range(len(current)):
            for simpler in _simpler(current[i]):
                trial = [*current[:i], simpler, *current[i + 1:]]
                if fails(trial):
                    current, changed = trial, True
                    break
    return current


def _ddmin(items: list[Op], fails: Callable[[list[Op]], bool]) -> list[Op]:
    """Zeller's ddmin: remove chunks while the rest still fails."""
    n = 2
    while len(items) >= 2:
        size = -(-len(items) // n)
        for start in range(0, len(items), size):
            rest = items[:start] + items[start + size:]
            if rest and fails(rest):
                items = rest
                n = max(n - 1, 2)
                break
        else:
            if n >= len(items):
                return items
            n = min(n * 2, len(items))
    return items


def _simpler(op: Op) -> list[Op]:
    """Simpler variants of an op: an admission with no chunk, no scope, a prompt of half
    its length, a block shorter or a token shorter; an append of its first token; an
    eviction of one block."""
    out = []
    if op.kind == "append" and len(op.tokens) > 1:
        out.append(replace(op, tokens=op.tokens[:1]))
    if op.kind == "evict" and op.num_blocks != 1:
        out.append(replace(op, num_blocks=1))
    if op.kind != "admit":
        return out
    if op.first_chunk is not None:
        out.append(replace(op, first_chunk=None))
    if op.scope is not None:
        out.append(replace(op, scope=None))
    n = len(op.tokens)
    for shorter in sorted({n // 2, n - B, n - 1}):
        if 0 < shorter < n:
            out.append(replace(op, tokens=op.tokens[:shorter],
                               first_chunk=None if op.first_chunk is None
                               else min(op.first_chunk, shorter)))
    return out


def _renamed(op_list: list[Op]) -> list[Op]:
    """`op_list` with its tokens renamed 1, 2, 3, ... in order of first use."""
    names: dict[int, int] = {}

    def rename(tokens: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(names.setdefault(t, len(names) + 1) for t in tokens)

    return [replace(op, tokens=rename(op.tokens)) if op.tokens else op for op in op_list]

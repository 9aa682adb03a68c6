"""AdmissionPlan and ReuseMatch: what admitting a prompt would reuse and need, before
anything changes.

`KvCacheManager.plan_admission` walks the tree once and returns a plan; `admit` carries
that plan out. A scheduler asks whether a request fits and admits it from the same walk
(nano-vllm's `can_allocate` / `allocate` pair), and "the pool is full" is a plan that
says so rather than an exception. `KvCacheManager.match_reuse` is the same walk reduced
to its `ReuseMatch` (block ids and counts): the lookup of a router or a benchmark.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Literal, NamedTuple

from kvcache.core.keys import ScopeKey
from kvcache.core.radix import Node, PartialHit

if TYPE_CHECKING:
    from kvcache.core.state import CacheState

PartialReuse = Literal["claim", "copy", "onboard"]


class ReuseMatch(NamedTuple):
    """What admitting a prompt would reuse now (TensorRT-LLM's v2 `ReuseMatch`).

    A snapshot of ids and counts that holds nothing; valid until the cache next changes.
    `num_tokens` tokens need no compute (any alignment; never a prompt's last token):
    `num_full_blocks` full blocks (block positions [0, num_full_blocks)), then with
    `partial` the leading tokens of one more block. Positions are those of the admitted
    sequence's `block_ids`:

        positions  0        num_skipped_blocks                  num_full_blocks
                   | skipped |  on the device: ids listed  | host |  partial
                              [------- block_ids ---------]        (+ its id if on the device)

    `num_skipped_blocks` leading positions are outside the sliding window of the first
    token to compute: the admission holds none of them (their blocks may be gone) and
    the sequence starts with them released (always 0 under full attention). The last
    `num_onboard_blocks` full blocks are in the host tier: the admission onboards them
    into new device blocks, so they have no device id yet (always 0 without a host
    tier). `block_ids` lists the device blocks of the other full positions, in order,
    then the partially matched block when it is on the device. `partial` says what the
    admission does with that block: "claim" it (an unused leaf, taken over as is),
    "copy" its matching tokens into a new block, or "onboard" them from the host tier.
    So `len(block_ids) == num_full_blocks - num_skipped_blocks - num_onboard_blocks +
    (partial in ("claim", "copy"))`.
    """

    block_ids: tuple[int, ...]
    num_tokens: int
    num_full_blocks: int
    partial: PartialReuse | None
    num_skipped_blocks: int = 0
    num_onboard_blocks: int = 0


class AdmissionPlan(NamedTuple):
    """A planned admission; valid for the manager that made it until its cache next
    changes. An immutable record, built by keyword (admission.py's `make_plan`).

    `num_cached_tokens` tokens would be reused: `num_full_blocks` full blocks (`hits`,
    pairs of tree node and blocks matched from its start; the held ones' device ids in
    `hit_block_ids`) and, with `partial_hit`, one partial block (claimed without a copy
    when `claim`, else copied). `num_new_blocks` blocks must be allocated, plus
    `num_onboard_blocks` for the full blocks it reuses from the host tier (their host
    slots end `hit_block_ids`); `num_available` can be had once the reused blocks are
    held, and `fits` says whether that is enough. Under a sliding window the first
    `num_skipped_blocks` positions are outside the window of its first token to compute
    (held by no one for it). `injected_fault` is set when the manager's fault-injection
    seam refused it. `cache` and `version` bind it to the state it was planned against:
    `admit` refuses a plan of another manager, or one made before the cache changed.
    The lists are the plan's own; nothing changes them.
    """

    cache: CacheState
    version: int
    tokens: array
    scope: ScopeKey
    num_blocks: int
    hits: list[tuple[Node, int]]
    hit_block_ids: list[int]
    num_full_blocks: int
    partial_hit: PartialHit | None
    num_cached_tokens: int
    num_new_blocks: int
    num_available: int
    num_skipped_blocks: int = 0
    num_onboard_blocks: int = 0
    injected_fault: bool = False

    @property
    def fits(self) -> bool:
        """True when `admit` would succeed now."""
        return (self.num_new_blocks + self.num_onboard_blocks <= self.num_available
                and not self.injected_fault)

    @property
    def partial(self) -> bool:
        """True when the last reused block is a partial match."""
        return self.partial_hit is not None

    @property
    def claim(self) -> bool:
        """True when the partial match takes over an unused leaf block (no copy)."""
        return self.partial_hit is not None and self.partial_hit.claim

    @property
    def reuse(self) -> ReuseMatch:
        """The reuse part of the plan as block ids and counts (built on each access)."""
        hit = self.partial_hit
        onboard = self.num_onboard_blocks
        ids = self.hit_block_ids
        if onboard:  # its ids list the host slots of its host hits last: not device blocks
            ids = ids[:len(ids) - onboard]
        if hit is None:
            return ReuseMatch(tuple(ids), self.num_cached_tokens, self.num_full_blocks, None,
                              self.num_skipped_blocks, onboard)
        if hit.node.host:
            return ReuseMatch(tuple(ids), self.num_cached_tokens, self.num_full_blocks,
                              "onboard", self.num_skipped_blocks, onboard)
        return ReuseMatch((*ids, hit.node.blocks[hit.at]), self.num_cached_tokens,
                          self.num_full_blocks, "claim" if hit.claim else "copy",
                          self.num_skipped_blocks, onboard)

    @property
    def num_reused_blocks(self) -> int:
        """Blocks reused, the partial one included."""
        return self.num_full_blocks + (self.partial_hit is not None)

    def __repr__(self) -> str:
        return (f"AdmissionPlan(tokens={len(self.tokens)}, cached={self.num_cached_tokens}, "
                f"full={self.num_full_blocks}, partial={self.partial}, claim={self.claim}, "
                f"new={self.num_new_blocks}, onboard={self.num_onboard_blocks}, "
                f"available={self.num_available}, fits={self.fits})")

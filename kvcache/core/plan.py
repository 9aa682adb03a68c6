"""AdmissionPlan and ReuseMatch: what admitting a prompt would reuse and need, before
anything changes.

`KVCacheManager.plan_admission` walks the tree once and returns a plan; `admit` carries
that plan out. A scheduler asks whether a request fits and admits it from the same walk
(nano-vllm's `can_allocate` / `allocate` pair), and "the pool is full" is a plan that
says so rather than an exception. `KVCacheManager.match_reuse` is the same walk reduced
to its `ReuseMatch` (block ids and counts): the lookup of a router or a benchmark.
"""

from __future__ import annotations

from array import array
from typing import Literal, NamedTuple

from kvcache.core.keys import ScopeKey
from kvcache.core.radix import Node, PartialHit

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


class AdmissionPlan:
    """A planned admission; valid for the manager that made it until its cache next
    changes.

    Read-only. `num_cached_tokens` tokens would be reused (`num_full_blocks` full blocks
    and, with `partial`, one partial block: claimed without a copy when `claim`, else
    copied); `num_new_blocks` blocks must be allocated, plus `num_onboard_blocks` for
    the full blocks it reuses from the host tier; `num_available` can be had once the
    reused blocks are held, and `fits` says whether that is enough. `injected_fault` is
    set when the manager's fault-injection seam refused it.
    """

    __slots__ = ("_available", "_block_ids", "_cached", "_fault", "_first", "_full", "_hits",
                 "_maker", "_need", "_num_blocks", "_onboard", "_partial", "_scope",
                 "_tokens", "_version")

    def __init__(self, maker: object, tokens: array, scope: ScopeKey, version: int,
                 num_blocks: int, hits: list[tuple[Node, int]], num_full_blocks: int,
                 partial: PartialHit | None, num_cached_tokens: int, num_new_blocks: int,
                 num_available: int,
                 block_ids: list[int], injected_fault: bool = False,
                 first_block: int = 0, num_onboard_blocks: int = 0) -> None:
        self._maker = maker  # the manager that made it: its nodes are that tree's
        self._tokens = tokens
        self._scope = scope
        self._version = version
        self._hits = hits
        self._partial = partial
        self._block_ids = block_ids
        self._num_blocks = num_blocks
        self._full = num_full_blocks
        self._cached = num_cached_tokens
        self._need = num_new_blocks
        self._available = num_available
        self._fault = injected_fault
        self._first = first_block  # sliding window: block positions before it are skipped
        self._onboard = num_onboard_blocks

    @property
    def fits(self) -> bool:
        """True when `admit` would succeed now."""
        return self._need + self._onboard <= self._available and not self._fault

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the admission would reuse (any alignment; never the last one)."""
        return self._cached

    @property
    def num_full_blocks(self) -> int:
        """Full blocks it would reuse."""
        return self._full

    @property
    def num_blocks(self) -> int:
        """Blocks the whole prompt occupies."""
        return self._num_blocks

    @property
    def num_new_blocks(self) -> int:
        """Blocks it would allocate (copy target, fresh blocks)."""
        return self._need

    @property
    def num_onboard_blocks(self) -> int:
        """Full blocks it reuses from the host tier: each takes a device block too."""
        return self._onboard

    @property
    def num_available(self) -> int:
        """Blocks obtainable once the reused blocks are held."""
        return self._available

    @property
    def injected_fault(self) -> bool:
        """True when the manager's fault-injection seam refused this admission."""
        return self._fault

    @property
    def partial(self) -> bool:
        """True when the last reused block is a partial match."""
        return self._partial is not None

    @property
    def claim(self) -> bool:
        """True when the partial match takes over an unused leaf block (no copy)."""
        return self._partial is not None and self._partial.claim

    @property
    def reuse(self) -> ReuseMatch:
        """The reuse part of the plan as block ids and counts (built on each access)."""
        ph = self._partial
        onboard = self._onboard
        # the plan's ids list the host slots of its host hits last: not device blocks
        ids = self._block_ids[:len(self._block_ids) - onboard] if onboard else self._block_ids
        if ph is None:
            return ReuseMatch(tuple(ids), self._cached, self._full, None, self._first, onboard)
        if ph.node.host:
            return ReuseMatch(tuple(ids), self._cached, self._full, "onboard", self._first,
                              onboard)
        return ReuseMatch((*ids, ph.node.blocks[ph.at]), self._cached, self._full,
                          "claim" if ph.claim else "copy", self._first, onboard)

    @property
    def num_reused_blocks(self) -> int:
        """Blocks reused, the partial one included."""
        return self._full + (self._partial is not None)

    def __repr__(self) -> str:
        return (f"AdmissionPlan(tokens={len(self._tokens)}, cached={self._cached}, "
                f"full={self._full}, partial={self.partial}, claim={self.claim}, "
                f"new={self._need}, onboard={self._onboard}, available={self._available}, "
                f"fits={self.fits})")

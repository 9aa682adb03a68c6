"""N cache replicas behind a router: what a cache-aware router buys over round-robin.

Each replica is a KvCacheManager with KV-cache events on. A request goes to the replica
the router picks; that replica admits it (reusing what it caches), computes its prompt
and generated tokens (commit) and frees it. The routers:

- `round_robin` and `random` (seeded) ignore the caches. Round-robin is sticky by
  accident wherever a workload's period is a multiple of N (turn-major chats whose count
  N divides return every turn to the same replica); random is not.
- `prefix` keeps one `harness.oracle.kv_index.EventIndex` per replica, fed only by that
  replica's events, and sends each request to the replica whose index predicts the
  longest reused prefix (ties: the replica that has served the fewest requests). It
  ignores load, so popular prefixes pile onto a few replicas, which then evict.
- `balanced_prefix` does the same among the replicas that have served at most
  BALANCE_SLACK more than their share so far (the least-served otherwise), as
  production cache-aware routers bound load imbalance.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

from harness.oracle.kv_index import EventIndex
from kvcache import KvCacheConfig, KvCacheManager

ROUTERS = ("round_robin", "random", "prefix", "balanced_prefix")
BALANCE_SLACK = 0.25  # balanced_prefix: no replica serves over 1.25x its share so far


class SimRequest(NamedTuple):
    """A prompt and the tokens its generation adds to the cache."""

    prompt: list[int]
    generated: list[int]


class RoutingResult(NamedTuple):
    """Outcome of one workload on N replicas under one router."""

    router: str
    replicas: int
    prompt_tokens: int
    saved_tokens: int      # prompt tokens reused (prefill not computed)
    requests_per_replica: tuple[int, ...]

    @property
    def hit_rate(self) -> float:
        """Prompt tokens reused / prompt tokens."""
        return self.saved_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        """Requests on the busiest replica / the mean (1.0: perfectly even)."""
        mean = sum(self.requests_per_replica) / len(self.requests_per_replica)
        return max(self.requests_per_replica) / mean if mean else 1.0


def footprint_blocks(requests: Sequence[SimRequest], block_size: int) -> int:
    """Blocks one unbounded replica caches after serving every request."""
    total = sum(-(-(len(r.prompt) + len(r.generated)) // block_size) for r in requests)
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=block_size, max_num_blocks=total))
    for i, r in enumerate(requests):
        _serve(mgr, i, r)
    return mgr.stats().cached_num_blocks


def _serve(mgr: KvCacheManager, rid: int, r: SimRequest) -> int:
    seq = mgr.add_sequence(rid, r.prompt)
    mgr.take_copy_ops()  # an engine applies them before the forward pass it commits
    mgr.commit(rid, len(r.prompt))
    if r.generated:
        # the last generated token's KV is never computed
        mgr.append_tokens(rid, r.generated[:-1])
        mgr.commit(rid, len(r.prompt) + len(r.generated) - 1)
    mgr.free_sequence(rid)
    return seq.num_cached_tokens


def simulate(requests: Sequence[SimRequest], replicas: int, router: str, block_size: int,
             pool_blocks: int) -> RoutingResult:
    """Serve `requests` in order on `replicas` replicas of `pool_blocks` blocks each.
    `random` draws from a fixed seed. Raises ValueError for an unknown router."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")
    cfg = KvCacheConfig(tokens_per_block=block_size, max_num_blocks=pool_blocks)
    mgrs = [KvCacheManager(cfg, kv_events=True) for _ in range(replicas)]
    indexes = [EventIndex(block_size) for _ in range(replicas)]
    served = [0] * replicas
    saved = 0
    rng = random.Random(0)
    everyone = range(replicas)
    for i, r in enumerate(requests):
        if router == "round_robin":
            pick = i % replicas
        elif router == "random":
            pick = rng.randrange(replicas)
        else:
            candidates: Sequence[int] = everyone
            if router == "balanced_prefix":
                cap = (i / replicas + 1) * (1 + BALANCE_SLACK)
                candidates = [k for k in everyone if served[k] < cap] or everyone
            pick = max(candidates,
                       key=lambda k: (indexes[k].probe(r.prompt), -served[k], -k))
        saved += _serve(mgrs[pick], i, r)
        served[pick] += 1
        indexes[pick].extend(mgrs[pick].take_kv_events())
    for mgr in mgrs:
        mgr.check_integrity()
    return RoutingResult(router, replicas, sum(len(r.prompt) for r in requests), saved,
                         tuple(served))

"""The oracle's bounded pools: a device pool of N blocks and a host tier of M, block by block.

Written from the rules in docs/design.md, not from `kvcache` (nothing is imported from
it): where `kvcache` keeps a tree of multi-block edges and heaps, this keeps two dicts of
cached block keys and scans them. A key is the oracle's (scope, tokens through the block)
for a full block, (scope, prefix, tail) for a partial leaf.

- The device holds cached blocks (held by live sequences or not) and each live
  sequence's private blocks (those not in the tree: new, decode, duplicates).
- Every cached block has a retention priority: the highest of its holders' since it was
  last unheld (a block a commit or a freed tail adds: its sequence's). A holder arriving
  while nobody holds the block sets it afresh; one arriving while others hold it can
  only raise it.
- An allocation takes free device blocks first, then evicts, one block at a time, the
  unheld device block with no device child of the lowest priority, the one whose last
  release is oldest among those. A full block is offloaded to the host, a partial one
  dropped.
- The host drops, one block at a time, the unpinned block with no child of the lowest
  priority, then oldest release (a block keeps its priority and time when it moves),
  whenever an offload needs its slot; never a block the same allocation offloaded (an
  eviction does not undo itself, however low the block ranks).
- An admission whose copy source (an unheld full block with followers) would take the
  last block it needs claims the source instead: its device followers are evicted first,
  deepest first, then the source becomes the sequence's block.
- An admission holds its device hits and pins its host hits, allocates its new blocks
  and one per host hit (the onboards), then moves the host hits to the device. A copy
  source counts as held by the admission and released at once, after every block
  released before (the clock advances first).
- A commit of a block cached on the host moves it to the device (the sequence's copy).

Exact for the cache, with any mix of priorities, when partial reuse is off and the host
can always take a whole eviction (host >= 2 x device is enough): two candidates then
never tie (a tie of release time means one sequence's path, where only the deepest
block is a candidate), and the cache's edge-at-a-time moves equal these block-at-a-time
ones. With partial reuse on it does not model the protected copy sources and forgone
partial hits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Key = tuple  # a cached block's key (see the module docstring)
Rank = tuple[int, int]  # a cached block's (retention priority, time of last release)


class Tiers:
    """Device and host occupancy and the two eviction orders. Mutated by the oracle."""

    def __init__(self, device_blocks: int, host_blocks: int,
                 children: Callable[[Key], Iterable[Key]], held: Callable[[Key], bool],
                 uncache: Callable[[Key], None]) -> None:
        self.device_blocks = device_blocks
        self.host_blocks = host_blocks
        self._children = children  # cached keys that follow a key (either tier)
        self._held = held  # whether a live sequence holds a key
        self._uncache = uncache  # forget a key the host dropped (or no tier could keep)
        # cached on the device, on the host -> (priority, time of last release); a held
        # block's time is set again when it is released
        self.device: dict[Key, Rank] = {}
        self.host: dict[Key, Rank] = {}
        self.pinned: set[Key] = set()
        self._arriving: set[Key] = set()  # offloaded by the allocation under way
        self.private = 0  # device blocks of live sequences outside the tree
        self.clock = 0  # advanced once per free and per copy, as the cache's
        self.evicted = self.offloaded = self.onboarded = self.dropped = 0
        # blocks handed out other than reuse hits (onboards excluded), those of them that
        # came from the free list, those allocated for appended tokens
        self.alloc_total = self.alloc_new = self.decode_alloc = 0

    # -- occupancy ---------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Device blocks holding nothing."""
        return self.device_blocks - len(self.device) - self.private

    def allocate(self, n: int) -> int:
        """`n` private device blocks: free ones first, then evicted ones; returns how many
        were free. ValueError when nothing is left to evict (the cache under test admitted
        what its pool cannot hold)."""
        fresh = min(n, self.free)
        for _ in range(n - self.free):
            self._evict_one()
        self._arriving.clear()
        assert self.free >= n, f"oracle: {n} blocks cannot be had ({self.free} free)"
        self.private += n
        return fresh

    def available(self, hits: Iterable[Key]) -> int:
        """Device blocks an admission holding `hits` could have: the free ones and every
        unheld one but those hits (under full attention an unheld block's followers are
        unheld too, so each can be evicted in turn)."""
        hit = set(hits)
        return self.free + sum(1 for k in self.device
                               if not self._held(k) and k not in hit and k not in self.pinned)

    def evict_below(self, key: Key) -> None:
        """Evict every device block that follows `key`, deepest first (a claimed copy
        source's followers)."""
        below: list[Key] = []
        todo = list(self._children(key))
        while todo:
            child = todo.pop()
            below.append(child)
            todo += self._children(child)
        for child in sorted(below, key=_depth, reverse=True):
            if child in self.device:
                self.device.pop(child)
                self.evicted += 1
                self._uncache(child)

    def append(self, n: int) -> None:
        """`n` blocks for a sequence's appended tokens (counted as decode blocks)."""
        fresh = self.allocate(n)
        self.alloc_total += n
        self.alloc_new += fresh
        self.decode_alloc += n

    def _evict_one(self) -> None:
        candidates = [k for k in self.device if not self._held(k) and k not in self.pinned
                      and not any(c in self.device for c in self._children(k))]
        if not candidates:  # the cache under test admitted more than its pool holds
            raise ValueError("oracle: nothing to evict (the cache admitted what cannot fit)")
        # lowest priority, then oldest release; the deeper block breaks a tie (a leaf
        # before its parent)
        key = min(candidates, key=lambda k: (*self.device[k], -_depth(k)))
        rank = self.device.pop(key)
        self.evicted += 1
        if len(key) == 2 and self.host_blocks and self._room():
            self.host[key] = rank
            self._arriving.add(key)
            self.offloaded += 1
        else:
            self._drop_below(key)
            self._uncache(key)

    def _room(self) -> bool:
        if len(self.host) < self.host_blocks:
            return True
        droppable = [k for k in self.host if k not in self.pinned and k not in self._arriving
                     and not any(True for _ in self._children(k))]
        if not droppable:
            return False
        victim = min(droppable, key=lambda k: (*self.host[k], -_depth(k)))
        del self.host[victim]
        self.dropped += 1
        self._uncache(victim)
        return True

    def _drop_below(self, key: Key) -> None:
        """Forget what the host holds below `key`, which leaves the cache."""
        for child in list(self._children(key)):
            self._drop_below(child)
            if child in self.host:
                del self.host[child]
                self.dropped += 1
                self._uncache(child)

    # -- the cache's operations ----------------------------------------------------------

    def hold(self, key: Key, priority: int) -> None:
        """A live sequence of retention `priority` starts holding cached block `key`
        (called before the oracle counts it as a holder): unheld until now, the block
        takes `priority`; held by others, it keeps the higher of the two."""
        tier = self.device if key in self.device else self.host
        old, time = tier[key]
        tier[key] = (max(old, priority) if self._held(key) else priority, time)

    def admit(self, hits: Iterable[Key], new_blocks: int, priority: int,
              source: Key | None = None) -> int:
        """An admission of retention `priority` reusing `hits` (held by now) and needing
        `new_blocks` more, with a partial hit copied from `source` (protected meanwhile,
        then released as a holder of `priority` would be); returns how many hits it
        onboards from the host."""
        on_host = [k for k in hits if k in self.host]
        self.pinned.update(on_host)
        if source is not None:
            self.pinned.add(source)
        fresh = self.allocate(new_blocks + len(on_host))
        self.pinned.clear()
        self.alloc_total += new_blocks  # the onboards' blocks are reuse hits
        self.alloc_new += min(fresh, new_blocks)
        for key in on_host:
            self.device[key] = self.host.pop(key)  # held: its time is set at release
        self.private -= len(on_host)
        self.onboarded += len(on_host)
        if source is not None and source in self.device:
            self._touch(self.device, source, priority)
        return len(on_host)

    def copy_from_host(self, key: Key, priority: int) -> bool:
        """A partial hit copied from `key` by an admission of `priority`: True when the
        copy is an onboard (the source is on the host, and counts as used now there)."""
        if key not in self.host:
            return False
        self._touch(self.host, key, priority)
        self.onboarded += 1
        return True

    def _touch(self, tier: dict[Key, Rank], key: Key, priority: int) -> None:
        """`key` held by an admission of `priority` and released at once (a copy source):
        a release after every earlier one, so the clock advances first."""
        self.clock += 1
        old, time = tier[key]
        tier[key] = (max(old, priority), time) if self._held(key) else (priority, self.clock)

    def cached(self, key: Key, priority: int) -> None:
        """A private block of a committing sequence of `priority` became cached block
        `key`, or (`key` on the host) replaced the host's copy of it; a freed sequence's
        tail joins the cache likewise."""
        self.host.pop(key, None)
        self.device[key] = (priority, self.clock)
        self.private -= 1

    def claimed(self, key: Key) -> None:
        """Cached block `key` became a sequence's private block."""
        del self.device[key]
        self.private += 1

    def tick(self) -> None:
        """A free: later releases are more recent."""
        self.clock += 1

    def released(self, key: Key) -> None:
        """No live sequence holds `key` any more: it is evictable from now, at the
        priority its holders gave it."""
        self.device[key] = (self.device[key][0], self.clock)

    def freed(self, private_blocks: int) -> None:
        """A sequence's private blocks went back to the free list."""
        self.private -= private_blocks


def _depth(key: Key) -> int:
    return len(key[1]) + (len(key[2]) if len(key) == 3 else 0)

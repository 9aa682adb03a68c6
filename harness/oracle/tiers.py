"""The oracle's bounded pools: a device pool of N blocks and a host tier of M, block by block.

Written from the rules in docs/design.md, not from `kvcache` (nothing is imported from
it): where `kvcache` keeps a tree of multi-block edges and heaps, this keeps two dicts of
cached block keys and scans them. A key is the oracle's (scope, tokens through the block)
for a full block, (scope, prefix, tail) for a partial leaf.

- The device holds cached blocks (held by live sequences or not) and each live
  sequence's private blocks (those not in the tree: new, decode, duplicates).
- An allocation takes free device blocks first, then evicts, one block at a time, the
  unheld device block with no device child whose last release is oldest. A full block is
  offloaded to the host, a partial one dropped.
- The host drops, one block at a time, the unpinned block with no child whose last
  release is oldest (a block keeps its time when it moves), whenever an offload needs
  its slot.
- An admission holds its device hits and pins its host hits, allocates its new blocks
  and one per host hit (the onboards), then moves the host hits to the device.
- A commit of a block cached on the host moves it to the device (the sequence's copy).

Exact for the cache when every evictable block has one priority (the log does not carry
priorities), partial reuse is off, and the host can always take a whole eviction
(host >= 2 x device is enough): ties of release time then never arise between two
candidates, and the cache's edge-at-a-time moves equal these block-at-a-time ones. With
partial reuse on it does not model the protected copy sources and forgone partial hits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Key = tuple  # a cached block's key (see the module docstring)


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
        self.device: dict[Key, int] = {}  # cached on the device -> time of last release
        self.host: dict[Key, int] = {}  # cached on the host -> time of last release
        self.pinned: set[Key] = set()
        self.private = 0  # device blocks of live sequences outside the tree
        self.clock = 0  # advanced once per free, as the cache's
        self.evicted = self.offloaded = self.onboarded = self.dropped = 0

    # -- occupancy ---------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Device blocks holding nothing."""
        return self.device_blocks - len(self.device) - self.private

    def allocate(self, n: int) -> None:
        """`n` private device blocks: free ones first, then evicted ones."""
        for _ in range(n - self.free):
            self._evict_one()
        assert self.free >= n, f"oracle: {n} blocks cannot be had ({self.free} free)"
        self.private += n

    def _evict_one(self) -> None:
        candidates = [k for k in self.device if not self._held(k) and k not in self.pinned
                      and not any(c in self.device for c in self._children(k))]
        assert candidates, "oracle: nothing to evict (the cache admitted what cannot fit)"
        # oldest release first; the deeper block breaks a tie (a leaf before its parent)
        key = min(candidates, key=lambda k: (self.device[k], -_depth(k)))
        time = self.device.pop(key)
        self.evicted += 1
        if len(key) == 2 and self.host_blocks and self._room():
            self.host[key] = time
            self.offloaded += 1
        else:
            self._drop_below(key)
            self._uncache(key)

    def _room(self) -> bool:
        if len(self.host) < self.host_blocks:
            return True
        droppable = [k for k in self.host if k not in self.pinned and not any(
            True for _ in self._children(k))]
        if not droppable:
            return False
        victim = min(droppable, key=lambda k: (self.host[k], -_depth(k)))
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

    def admit(self, hits: Iterable[Key], new_blocks: int, source: Key | None = None) -> int:
        """An admission reusing `hits` (held by now) and needing `new_blocks` more, with
        a partial hit copied from `source` (protected meanwhile); returns how many hits
        it onboards from the host."""
        on_host = [k for k in hits if k in self.host]
        self.pinned.update(on_host)
        if source is not None:
            self.pinned.add(source)
        self.allocate(new_blocks + len(on_host))
        self.pinned.clear()
        for key in on_host:
            del self.host[key]
            self.device[key] = self.clock  # held: its time is set again at release
        self.private -= len(on_host)
        self.onboarded += len(on_host)
        return len(on_host)

    def copy_from_host(self, key: Key) -> bool:
        """A partial hit copied from `key`: True when the copy is an onboard (the source is
        on the host, and counts as used now there)."""
        if key not in self.host:
            return False
        self.host[key] = self.clock
        self.onboarded += 1
        return True

    def cached(self, key: Key) -> None:
        """A private block of a committing sequence became cached block `key`, or (`key`
        on the host) replaced the host's copy of it."""
        self.host.pop(key, None)
        self.device[key] = self.clock
        self.private -= 1

    def claimed(self, key: Key) -> None:
        """Cached block `key` became a sequence's private block."""
        del self.device[key]
        self.private += 1

    def tick(self) -> None:
        """A free: later releases are more recent."""
        self.clock += 1

    def released(self, key: Key) -> None:
        """No live sequence holds `key` any more: it is evictable from now."""
        self.device[key] = self.clock

    def freed(self, private_blocks: int) -> None:
        """A sequence's private blocks went back to the free list."""
        self.private -= private_blocks


def _depth(key: Key) -> int:
    return len(key[1]) + (len(key[2]) if len(key) == 3 else 0)

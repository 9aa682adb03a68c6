"""Block radix tree: match, insert, split and prune of cached KV blocks.

Each reuse scope has its own root. An edge (a `Node`) holds a *run* of full blocks: its
key is the token bytes of all of them and `blocks` their physical ids, so matching a long
shared prefix is one C-level byte comparison instead of a Python step per block. Edges
are split on demand, exactly where a match or a reference starts or stops, so reference
counts, LRU time and priority are uniform within an edge. A partial block (fewer than
`tokens_per_block` tokens) only ever appears as a leaf of its own.

Keys are token bytes in the format of kvcache/core/keys.py.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import NamedTuple

from kvcache.core.keys import TOKEN_BYTES, ScopeKey, common_prefix_bytes


class Node:
    """One edge of the tree: a run of full blocks, or a single partial leaf block.

    `ref` counts the holders (live sequences, or an admission protecting a copy source)
    whose path runs through this edge. Under full attention a holder holds the whole
    chain up to the root, so a referenced node's ancestors are referenced too and every
    unreferenced node is evictable once its (unreferenced) descendants are gone. Under a
    sliding window a holder holds a segment of the chain (the blocks in its window), and
    an unreferenced interior node can lose its blocks: it stays as a *hollow* node (key
    kept, `blocks` empty) so the blocks below it keep their identity, their whole prefix.

    `host` is True when the edge lives in the host tier: `blocks` are then host slots.
    Every descendant of a host edge is a host edge too (see kvcache/core/host_tier.py).
    """

    __slots__ = ("blocks", "children", "first", "full", "head", "host", "key", "last_used",
                 "parent", "priority", "ref", "stamp")

    def __init__(self, key: bytes, blocks: list[int], parent: Node | None, first: bytes,
                 head: bytes | None) -> None:
        self.key = key
        self.blocks = blocks
        self.parent = parent
        # `first` (its first token) and `head` (its first block; None for a partial block)
        # are the very objects the parent's `children` and `full` indexes hold, so a split
        # or merge re-indexes without slicing or hashing the key again
        self.first = first
        self.head = head
        # children by first token: siblings sharing one are the partial-match candidates
        self.children: dict[bytes, list[Node]] = {}
        # full-block children by their first block (unique: shared blocks are one edge),
        # so the walk finds its next edge in one lookup however many siblings diverge
        # inside that block
        self.full: dict[bytes, Node] = {}
        self.ref = 0
        self.last_used = 0
        self.priority = 0
        self.stamp = 0
        self.host = False

    def __repr__(self) -> str:
        where = ", host" if self.host else ""
        return (f"Node(tokens={len(self.key) // TOKEN_BYTES}, blocks={self.blocks}, "
                f"ref={self.ref}{where})")


class PartialHit(NamedTuple):
    """A partial match inside block `at` of `node` covering `num_tokens` tokens."""

    node: Node
    at: int
    num_tokens: int
    claim: bool  # an unused leaf block: taken over without a copy


class TreeMatch(NamedTuple):
    """The tree's match of a prompt (nodes, not ids); valid until the tree next changes.

    `hits` lists (node, blocks matched from its start); only the last may stop inside
    its node. `num_tokens` = num_full_blocks * tokens_per_block + partial tokens.
    """

    hits: list[tuple[Node, int]]
    num_full_blocks: int
    partial: PartialHit | None
    num_tokens: int


class BlockRadixTree:
    """Per-scope radix trees of cached blocks. Pure structure: no ref counting policy."""

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.block_bytes = tokens_per_block * TOKEN_BYTES
        self.roots: dict[ScopeKey, Node] = {}
        self.num_nodes = 0

    def root(self, key: ScopeKey) -> Node:
        """The root of scope `key`, created on first use (roots hold no blocks)."""
        node = self.roots.get(key)
        if node is None:
            node = self.roots[key] = Node(b"", [], None, b"", None)
        return node

    def match(self, start: Node, key_bytes: bytes, limit: int, partial: bool,
              copy_on_partial: bool) -> TreeMatch:
        """Match token bytes `key_bytes[:limit]` below `start`: full blocks, then one
        partial.

        Pure: mutates nothing. `limit` is in bytes. The partial candidate is taken only
        when `partial`; an in-use or interior candidate only when `copy_on_partial`.
        """
        block_bytes = self.block_bytes
        full_end = limit - limit % block_bytes
        node = start
        offset = 0
        hits: list[tuple[Node, int]] = []
        while offset < full_end:
            child = node.full.get(key_bytes[offset:offset + block_bytes])
            if child is None:
                break
            key = child.key
            end = offset + len(key)
            if end <= full_end and key_bytes.startswith(key, offset):
                # not len(blocks): a hollow node has none
                hits.append((child, len(key) // block_bytes))
                offset = end
                node = child
                continue
            # The edge matches part of the way (at least its first block): the walk stops
            # inside it, and the only partial candidate is its next block. One comparison
            # up to `limit` gives both the full blocks and that block's common prefix.
            left = limit - offset
            same = common_prefix_bytes(key_bytes, offset, key,
                                       left if left < len(key) else len(key))
            matched = (same if same < full_end - offset else full_end - offset) // block_bytes
            hits.append((child, matched))
            offset += matched * block_bytes
            hit = None
            if partial and limit - offset >= TOKEN_BYTES:
                hit = self._partial_inside(child, matched,
                                           (same - matched * block_bytes) // TOKEN_BYTES,
                                           copy_on_partial)
            return TreeMatch(hits, offset // block_bytes, hit, offset // TOKEN_BYTES
                             + (hit.num_tokens if hit is not None else 0))
        hit = None
        if partial and limit - offset >= TOKEN_BYTES and node.children:
            hit = self._partial(node, key_bytes, offset, limit, copy_on_partial)
        return TreeMatch(hits, offset // block_bytes, hit,
                         offset // TOKEN_BYTES + (hit.num_tokens if hit is not None else 0))

    @staticmethod
    def _partial_inside(mid: Node, index: int, num_tokens: int,
                        copy_on_partial: bool) -> PartialHit | None:
        """Block `index` of `mid`, whose first `num_tokens` tokens match, as a partial hit:
        claimed when it is the last block of an unused device leaf, else copied (if
        allowed); none from a hollow node (no KV to claim or copy)."""
        if not num_tokens or not mid.blocks:
            return None
        # a host block is never claimed: a sequence's blocks are device blocks
        claim = (mid.ref == 0 and not mid.children and index == len(mid.blocks) - 1
                 and not mid.host)
        if not (claim or copy_on_partial):
            return None
        return PartialHit(mid, index, num_tokens, claim)

    def _partial(self, node: Node, key_bytes: bytes, offset: int, limit: int,
                 copy_on_partial: bool) -> PartialHit | None:
        """The best partial hit among the children of `node` for the tokens at `offset`."""
        most = min(limit - offset, self.block_bytes)
        best: PartialHit | None = None
        for child in node.children.get(key_bytes[offset:offset + TOKEN_BYTES], ()):
            claim = (child.ref == 0 and not child.children and len(child.blocks) == 1
                     and not child.host)
            if not (claim or copy_on_partial) or not child.blocks:
                continue
            same = common_prefix_bytes(key_bytes, offset, child.key,
                                       min(most, len(child.key))) // TOKEN_BYTES
            if (best is None or same > best.num_tokens
                    or (same == best.num_tokens and claim and (
                        not best.claim or len(child.key) <= len(best.node.key)))):
                # a tie goes to a claim, then to the claim that takes the fewest cached
                # tokens out of the tree, then to the leaf attached last
                best = PartialHit(child, 0, same, claim)
        return best if best is not None and best.num_tokens else None

    def add_child(self, parent: Node, key: bytes, blocks: list[int]) -> Node:
        """Attach a new unreferenced node under `parent` and return it."""
        block_bytes = self.block_bytes
        head = key[:block_bytes] if len(key) >= block_bytes else None
        node = Node(key, blocks, parent, key[:TOKEN_BYTES], head)
        parent.children.setdefault(node.first, []).append(node)
        if head is not None:
            parent.full[head] = node
        self.num_nodes += 1
        return node

    def extend_leaf(self, node: Node, key: bytes, blocks: list[int]) -> None:
        """Append full blocks (token bytes `key`, ids `blocks`) to leaf `node` in place,
        so a sequence committing chunk after chunk keeps one edge."""
        assert not node.children and len(node.key) == len(node.blocks) * self.block_bytes
        node.key += key
        node.blocks += blocks

    def split(self, node: Node, nblocks: int) -> Node:
        """Split `node` after its first `nblocks` blocks; returns the new upper node.

        `node` keeps the lower part (and its children, heap entries and the holders that
        end in it), so holders' chains stay valid; the upper part copies ref, time and
        priority, as every holder of `node` holds both parts. A hollow node splits into
        two hollow ones.
        """
        cut = nblocks * self.block_bytes
        assert 0 < cut < len(node.key), (nblocks, node)
        parent = node.parent
        assert parent is not None and node.head is not None
        key = node.key
        top = Node(key[:cut], node.blocks[:nblocks], parent, node.first, node.head)
        top.ref, top.last_used, top.priority = node.ref, node.last_used, node.priority
        top.host = node.host
        siblings = parent.children[node.first]
        siblings[siblings.index(node)] = top
        parent.full[node.head] = top
        node.key = key = key[cut:]
        node.first = first = key[:TOKEN_BYTES]
        node.head = head = key[:self.block_bytes]
        del node.blocks[:nblocks]
        node.parent = top
        top.children[first] = [node]
        top.full[head] = node
        self.num_nodes += 1
        return top

    def merge(self, top: Node, node: Node) -> None:
        """Fold `top` into its only child `node` (the inverse of `split`).

        Callers merge only when both parts have the same holders, time and priority, so
        nothing observable changes; `node` survives, keeping the holders that end in it.
        """
        parent = top.parent
        assert parent is not None and node.parent is top and len(top.children) == 1
        assert top.head is not None
        node.key = top.key + node.key
        node.blocks = top.blocks + node.blocks
        node.first = top.first
        node.head = top.head
        node.parent = parent
        siblings = parent.children[top.first]
        siblings[siblings.index(top)] = node
        parent.full[top.head] = node
        top.parent = None  # stale heap entries of `top` now fail validation
        top.children = {}
        top.full = {}
        self.num_nodes -= 1

    def hollow(self, node: Node) -> list[int]:
        """Take every block of interior `node`, leaving its key as a hollow path to its
        children; returns the ids. A hollow parent or only child is merged into it, so
        a run of hollow blocks stays one edge."""
        assert node.children and node.blocks and node.parent is not None, node
        ids = node.blocks
        node.blocks = []
        if len(node.children) == 1:
            (siblings,) = node.children.values()
            if len(siblings) == 1 and not siblings[0].blocks:  # fold into a hollow child
                child = siblings[0]
                self.merge(node, child)
                node = child
        parent = node.parent
        assert parent is not None
        if (parent.parent is not None and not parent.blocks and len(parent.children) == 1
                and len(parent.children[node.first]) == 1):
            self.merge(parent, node)
        return ids

    def prune(self, node: Node) -> None:
        """Detach `node` and then every hollow ancestor left without children: a hollow
        path that leads to no block identifies nothing."""
        parent = self.detach(node)
        while parent.parent is not None and not parent.blocks and not parent.children:
            parent = self.detach(parent)

    def detach(self, node: Node) -> Node:
        """Remove leaf `node` from the tree; returns its former parent."""
        assert not node.children, node
        parent = node.parent
        assert parent is not None, "cannot detach a root"
        siblings = parent.children[node.first]
        siblings.remove(node)
        if not siblings:
            del parent.children[node.first]
        if node.head is not None:
            del parent.full[node.head]
        node.parent = None
        self.num_nodes -= 1
        return parent

    def trim(self, node: Node, nblocks: int) -> list[int]:
        """Drop the last `nblocks` blocks of leaf `node`; returns their ids."""
        assert not node.children and 0 < nblocks < len(node.blocks), (nblocks, node)
        keep = len(node.blocks) - nblocks
        ids = node.blocks[keep:]
        del node.blocks[keep:]
        node.key = node.key[:keep * self.block_bytes]
        return ids

    def walk(self) -> Iterator[tuple[ScopeKey, Node]]:
        """Every non-root node with its scope key, parents before children."""
        for key, root in self.roots.items():
            stack = [root]
            while stack:
                node = stack.pop()
                for siblings in node.children.values():
                    for child in siblings:
                        yield key, child
                        stack.append(child)

    def dump(self, max_nodes: int = 200) -> str:
        """A readable picture of the tree for failure messages."""
        lines: list[str] = []
        for key, root in self.roots.items():
            lines.append(f"scope {key!r}")
            stack = [(root, 1)]
            while stack and len(lines) < max_nodes:
                node, depth = stack.pop()
                for siblings in node.children.values():
                    for child in siblings:
                        toks = array("I", child.key).tolist()
                        head = toks[:8]
                        more = "..." if len(toks) > 8 else ""
                        lines.append(f"{'  ' * depth}{head}{more} tokens={len(toks)} "
                                     f"{'slots' if child.host else 'blocks'}={child.blocks} "
                                     f"ref={child.ref} prio={child.priority} "
                                     f"t={child.last_used}")
                        stack.append((child, depth + 1))
        return "\n".join(lines)

"""What both SGLang adapters share over one tree (`sglang.SglangCache`, the tree's caller,
and `sglang_scheduler.SglangScheduled`, SGLang's own scheduler code as its caller): the
plumbing of one tree (`SglangTree`: the retracted sequences, the harness log, eviction,
the events, the contract, the harness's gauges), the page-ownership check every SGLang
adapter runs (`page_problems`), RadixCache's pages read from its nodes
(`radix_tree_pages`), SGLang's KV events as the harness's dicts (`normalise_event`) and
whether a release has a module (`has_module`). Runs in an SGLang venv, but imports nothing of SGLang itself.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Hashable
from typing import Any

from harness.conform.protocol import Contract, event_kind

# the first release whose host tier, window and Mamba state are only UnifiedRadixCache's
# components (its wheel has no hiradix_cache.py, swa_radix_cache.py, mamba_radix_cache.py)
UNIFIED_ONLY = "0.5.21"


def has_module(name: str) -> bool:
    """Whether this release has module `name`, read without importing it (a missing
    parent package, or a parent that is a module: no)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def radix_tree_pages(tree: Any, page_size: int) -> set[int]:
    """The pages a RadixCache's nodes hold, its nodes walked (its all_values_flatten fails
    on an empty tree)."""
    pages: set[int] = set()
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not tree.root_node and node.value is not None:
            pages |= {int(x) // page_size for x in node.value.tolist()}
    return pages


def page_problems(held: list[int], free_list: list[int], tree_pages: set[int],
                  num_pages: int, holders: str) -> list[str]:
    """What is wrong with the ownership of pages 1..num_pages (page 0 is SGLang's
    padding): each must be free (`free_list`, a page listed twice is free twice), in the
    tree (`tree_pages`) or held by one of the `holders` (`held`: a page once per holder
    that holds it), never two of these. Empty when all is well."""
    out: list[str] = []
    free = set(free_list)
    if len(held) != len(set(held)):
        out.append(f"pages held by two {holders}: {sorted(held)}")
    if len(free_list) != len(free):
        out.append(f"pages free twice: {sorted(p for p in free if free_list.count(p) > 1)}")
    for what, a, b in (("held and free", set(held), free),
                       ("in the tree and free", tree_pages, free),
                       ("held and in the tree", set(held), tree_pages)):
        if a & b:
            out.append(f"pages both {what}: {sorted(a & b)}")
    lost = set(range(1, num_pages + 1)) - set(held) - tree_pages - free
    if lost:
        out.append(f"pages owned by nobody (leaked): {sorted(lost)}")
    return out


class SglangTree:
    """What the two SGLang adapters share over one tree: the retracted sequences, the
    harness log, eviction, the events, the contract and the harness's gauges. A subclass
    sets `tree`, `block_size`, `num_blocks`, `record`, `_contract`, `_preempted` and
    `_log`, and defines `_evict_tokens`, `used_blocks` and `stats`."""

    tree: Any
    block_size: int
    num_blocks: int
    record: bool
    _contract: Contract
    _preempted: list[Hashable]
    _log: list[dict[str, Any]]

    @property
    def contract(self) -> Contract:
        """The contract of this release and tree."""
        return self._contract

    def _evict_tokens(self, num_tokens: int) -> int:
        raise NotImplementedError

    def used_blocks(self) -> int:
        raise NotImplementedError

    def _total(self) -> int:
        """Tokens in the tree (a unified tree's `total_size` is per component: its first)."""
        total = self.tree.total_size()
        return int(total[0] if isinstance(total, tuple) else total)

    def _harness_stats(self) -> dict[str, int | float]:
        """The harness's gauges, in blocks."""
        P, used = self.block_size, self.used_blocks()
        return {"maxNumBlocks": self.num_blocks, "usedNumBlocks": used,
                "freeNumBlocks": self.num_blocks - used, "cachedNumBlocks": self._total() // P,
                "tokensPerBlock": P}

    def take_preempted(self) -> list[Hashable]:
        """The sequences `preempt` retracted since the last call."""
        out, self._preempted = self._preempted, []
        return out

    def evict(self, num_blocks: int) -> int:
        """The tree's `evict(num_tokens)`: whole leaves, so possibly more than asked."""
        return self._evict_tokens(num_blocks * self.block_size) // self.block_size

    def take_events(self) -> list[dict[str, Any]]:
        """SGLang's KV events as the harness's dicts (hashes as text)."""
        return [normalise_event(e) for e in self.tree.take_events()] if self.record else []

    def take_log(self) -> list[dict[str, Any]]:
        """The harness log since the last call."""
        out, self._log = self._log, []
        return out

    def cached_hashes(self) -> None:
        """The tree's state names no event hashes (they are computed as events go)."""
        return None


def _text(h: Any) -> str | None:
    if h is None:
        return None
    return h.hex() if isinstance(h, (bytes, bytearray)) else str(h)


def normalise_event(event: Any) -> dict[str, Any]:
    """One of SGLang's KV events as the harness's dict (hashes as text; the fields beyond
    the hash a release does not have are None)."""
    kind = event_kind(event)
    out: dict[str, Any] = {"type": kind}
    if kind in ("BlockStored", "BlockRemoved"):
        out["block_hashes"] = [_text(h) for h in event.block_hashes]
        medium = getattr(event, "medium", None)
        out["medium"] = "GPU" if medium is None else str(getattr(medium, "value", medium))
    if kind == "BlockStored":
        out.update(parent_block_hash=_text(event.parent_block_hash),
                   token_ids=[int(t) for t in event.token_ids], block_size=event.block_size,
                   salt=None, lora_id=None, lora_name=getattr(event, "lora_name", None),
                   cache_salt=getattr(event, "cache_salt", None)
                   or getattr(getattr(event, "metadata", None), "cache_salt", None),
                   session_id=getattr(event, "session_id", None))
    return out

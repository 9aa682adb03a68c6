"""The order in which the cache saw admissions, commits, appends and frees.

Recorded when `KVCacheManager(record_events=True)`; an independent oracle replays it to
predict reuse under any batching or chunking.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Literal, NamedTuple

EventKind = Literal["admit", "commit", "append", "free"]


class CacheEvent(NamedTuple):
    """One cache operation: admit (tokens, scope), commit (num_tokens), append (tokens), free."""

    kind: EventKind
    seq_id: Hashable
    tokens: tuple[int, ...] = ()
    num_tokens: int = 0
    scope: Hashable | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly form."""
        return {"kind": self.kind, "seq_id": self.seq_id, "tokens": list(self.tokens),
                "num_tokens": self.num_tokens, "scope": self.scope}

"""Token prefixes in context, interned: (scope, tokens[:n]) as one small int.

The KV of a token depends on the scope and on every token before it, so "what a KV slot
holds" and "which cached block a prefix maps to" are both a (scope, prefix) pair. Both
the provenance and the capacity oracle key on it; interning makes the key one int, built
a token at a time, instead of an n-token tuple per position.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

_SHOWN = 8  # tokens shown at the end of a long prefix in messages


class Prefixes:
    """An interning table of (scope, token prefix); grows only (mutated by `extend`)."""

    def __init__(self) -> None:
        self._child: dict[tuple[int, int], int] = {}
        self._up: list[tuple[int, int]] = []  # id -> (parent id, token); (-1, -1) for roots
        self._roots: dict[Hashable, int] = {}
        self._scope: dict[int, Hashable] = {}

    def root(self, scope: Hashable) -> int:
        """The id of the empty prefix of `scope`."""
        pid = self._roots.get(scope)
        if pid is None:
            pid = self._roots[scope] = len(self._up)
            self._up.append((-1, -1))
            self._scope[pid] = scope
        return pid

    def extend(self, pid: int, tokens: Sequence[int]) -> list[int]:
        """Ids of prefix `pid` extended by each of `tokens` in turn (one per token)."""
        out = []
        child, up = self._child, self._up
        for tok in tokens:
            nxt = child.get((pid, tok))
            if nxt is None:
                nxt = child[(pid, tok)] = len(up)
                up.append((pid, tok))
            out.append(nxt)
            pid = nxt
        return out

    def tokens(self, pid: int) -> tuple[Hashable, list[int]]:
        """(scope, tokens) of prefix `pid`."""
        toks: list[int] = []
        while self._up[pid][0] >= 0:
            pid, tok = self._up[pid]
            toks.append(tok)
        return self._scope[pid], toks[::-1]

    def describe(self, pid: int | None) -> str:
        """`scope None, tokens [1, 2, 2]`, or for a long prefix its end and length
        (`tokens [..., 8, 9] (40)`); `never written` for None."""
        if pid is None:
            return "never written"
        scope, toks = self.tokens(pid)
        shown = ", ".join(map(str, toks[-_SHOWN:]))
        if len(toks) > _SHOWN:
            return f"scope {scope!r}, tokens [..., {shown}] ({len(toks)})"
        return f"scope {scope!r}, tokens [{shown}]"

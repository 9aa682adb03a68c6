"""Release numbers as the package registry writes them, their order, and the nearest one.

A version is PEP 440's public form that engines publish, plus a local label for a
checkout: `0.33.0`, `0.5.6.post2`, `0.10.1.1`, `0.34.0rc1`, `0.33.1.dev3+gabc1234`.
`parse_version` orders them as pip does (a dev release before its release, a pre-release
before the final one, a post release after it; the local label only breaks ties).
`nearest` picks, for a release the harness has no lock or contract for, the known one
whose lock and contract it takes: the newest known release not newer than it (an engine's
behaviour changes at a release and holds until the next), else the oldest known.
Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

VERSION_PATTERN = (r"[0-9]+(?:\.[0-9]+){1,3}(?:(?:a|b|rc)[0-9]+)?(?:\.post[0-9]+)?"
                   r"(?:\.dev[0-9]+)?(?:\+[a-z0-9]+(?:\.[a-z0-9]+)*)?")
_VERSION = re.compile(r"([0-9]+(?:\.[0-9]+){1,3})(?:(a|b|rc)([0-9]+))?(?:\.post([0-9]+))?"
                      r"(?:\.dev([0-9]+))?(?:\+([a-z0-9]+(?:\.[a-z0-9]+)*))?")
_PRE = {"a": 0, "b": 1, "rc": 2}
_FINAL = 3  # a final release sorts after its pre-releases


class Version(NamedTuple):
    """A parsed version; compare `key` (tuples sort as pip sorts the versions)."""

    text: str
    release: tuple[int, ...]
    pre: tuple[int, int] | None
    post: int | None
    dev: int | None
    local: str | None

    @property
    def key(self) -> tuple[object, ...]:
        """The sort key: release (trailing zeros dropped), pre, post, dev, local."""
        release = list(self.release)
        while len(release) > 1 and release[-1] == 0:
            release.pop()
        # a dev release of a final release sorts before its pre-releases
        pre = self.pre if self.pre is not None else \
            ((-1, 0) if self.dev is not None and self.post is None else (_FINAL, 0))
        post = -1 if self.post is None else self.post
        dev = self.dev if self.dev is not None else 1 << 62
        return (tuple(release), pre, post, dev, self.local or "")

    @property
    def is_release(self) -> bool:
        """A registry release (final or post): no dev number, pre-release or local label."""
        return self.pre is None and self.dev is None and self.local is None


def parse_version(text: str) -> Version:
    """`text` parsed; ValueError naming it when it is not a version (see the module)."""
    m = _VERSION.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a version like 0.33.0, 0.5.6.post2 or "
                         "0.33.1.dev3+gabc1234")
    pre = (_PRE[m[2]], int(m[3])) if m[2] else None
    return Version(text.strip(), tuple(int(p) for p in m[1].split(".")), pre,
                   None if m[4] is None else int(m[4]), None if m[5] is None else int(m[5]),
                   m[6])


def sort_versions(texts: Iterable[str]) -> list[str]:
    """`texts` oldest first; ValueError for one that is not a version."""
    return sorted(texts, key=lambda t: parse_version(t).key)


def nearest(version: str, known: Iterable[str]) -> str | None:
    """The known release whose lock and contract `version` takes (see the module
    docstring); `version` itself when known; None when nothing is known."""
    want = parse_version(version).key
    ordered = sort_versions(known)
    if not ordered:
        return None
    older = [v for v in ordered if parse_version(v).key <= want]
    return older[-1] if older else ordered[0]

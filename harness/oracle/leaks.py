"""The leak check over anything that owns a KV cache: the `CacheOwner` protocol and
`leak_problems`.

The pytest plugin runs it on the owners found among a test's fixture values
(`harness.plugin.leaks`); the conformance judge (`harness.conform.controller.judge`) runs it over
any engine's cache whenever nothing is live. Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable


@runtime_checkable
class CacheOwner(Protocol):
    """Something that owns cache blocks and can account for them."""

    def check_integrity(self) -> None:
        """Raise (AssertionError, naming the broken invariant) if internal state is corrupt."""

    def leak_report(self) -> list[str]:
        """One line per leak; empty when every block is free or evictable and nothing is held."""


def leak_problems(owners: Iterable[tuple[str, CacheOwner]]) -> list[str]:
    """What is wrong with each owner, one line per problem; empty when all are clean.

    Calls `check_integrity()` and `leak_report()`; an exception from either is a problem
    (reported with its type and message), never swallowed.
    """
    problems: list[str] = []
    for label, owner in owners:
        kind = type(owner).__name__
        try:
            owner.check_integrity()
        except Exception as exc:  # any failure of the check is what we report
            problems.append(f"{label} ({kind}): check_integrity() failed: "
                            f"{type(exc).__name__}: {exc}")
        try:
            report = owner.leak_report()
        except Exception as exc:
            problems.append(f"{label} ({kind}): leak_report() raised {type(exc).__name__}: {exc}")
            continue
        if not isinstance(report, list):
            problems.append(f"{label} ({kind}): leak_report() returned a "
                            f"{type(report).__name__}, expected a list of strings")
            continue
        problems.extend(f"{label} ({kind}): leaked: {line}" for line in report)
    return problems

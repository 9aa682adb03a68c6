"""Leak checks for anything that owns a KV cache, found among a test's fixture values.

The contract is the `CacheOwner` protocol: `check_integrity()` raises when an internal
invariant is broken, `leak_report()` returns one line per leaked block, sequence or hold
(empty when everything is free or evictable). `kvcache.KvCacheManager` is one; another
engine's cache joins by providing the two methods.

A fixture value is checked when it is an owner, when it reaches one through an attribute
named in `OWNER_ATTRIBUTES` (`kvcache.Engine.manager`, an adapter's `cache_manager`), or
when it lists owners through `cache_owners()` (a factory). The plugin calls
`find_cache_owners` on a test's fixture values after its call phase and `leak_problems`
on what it finds. The protocol and `leak_problems` live in `harness.oracle.leaks`, where
the conformance judge runs the same check over any engine's cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping

from harness.oracle.leaks import CacheOwner, leak_problems

__all__ = ["OWNER_ATTRIBUTES", "CacheLeakError", "CacheOwner", "find_cache_owners",
           "is_cache_owner", "leak_problems"]


def _has_method(obj: object, name: str) -> bool:
    # Look on the class, not through __getattr__: a mock or proxy answering every name
    # must not pass for a cache owner.
    try:
        attr = inspect.getattr_static(type(obj), name)
    except AttributeError:
        return False
    return callable(attr) or isinstance(attr, staticmethod | classmethod)


def is_cache_owner(obj: object) -> bool:
    """True if `obj`'s class defines both `check_integrity` and `leak_report`."""
    return _has_method(obj, "check_integrity") and _has_method(obj, "leak_report")


# Attributes through which an engine, or an adapter around one, exposes its cache:
# `kvcache.Engine.manager` and `KvcacheEngineAdapter.cache_manager`. Another project's
# engine joins by naming its cache one of these, by being an owner itself, or by
# listing its caches in `cache_owners()`.
OWNER_ATTRIBUTES = ("manager", "cache_manager")


def _reached(label: str, value: object) -> Iterator[tuple[str, CacheOwner]]:
    """`value` if it is an owner, then the owners behind its OWNER_ATTRIBUTES."""
    if is_cache_owner(value):
        yield label, value  # type: ignore[misc]  # checked structurally just above
    for name in OWNER_ATTRIBUTES:
        try:
            inspect.getattr_static(value, name)  # not through __getattr__ (mocks, proxies)
        except AttributeError:
            continue
        attr = getattr(value, name)  # may be a property
        if is_cache_owner(attr):
            yield f"{label}.{name}", attr


def _owned(label: str, value: object) -> Iterator[tuple[str, CacheOwner]]:
    yield from _reached(label, value)
    if not _has_method(value, "cache_owners"):
        return
    for i, item in enumerate(value.cache_owners()):  # type: ignore[attr-defined]
        where = f"{label}.cache_owners()[{i}]"
        owners = list(_reached(where, item))
        if not owners:
            raise TypeError(f"{where} is a {type(item).__name__}, which lacks "
                            "check_integrity() or leak_report() and has no "
                            f"{' or '.join(OWNER_ATTRIBUTES)} that has them")
        yield from owners


def find_cache_owners(values: Mapping[str, object]) -> list[tuple[str, CacheOwner]]:
    """Cache owners among fixture `values` (name -> value), each once, labelled by path.

    A value counts when it is an owner itself, when an attribute named in
    `OWNER_ATTRIBUTES` is one (an engine: `engine.manager`), or when it has
    `cache_owners()` returning owners or objects that reach one the same way (a factory).
    Attributes are looked up on the object's class and instance, never through
    `__getattr__`, so a mock is not mistaken for an engine; an attribute that is not an
    owner is ignored. Returns (label, owner) pairs in fixture order; mutates nothing.
    Raises TypeError when `cache_owners()` yields something that reaches no owner.
    """
    seen: set[int] = set()
    found: list[tuple[str, CacheOwner]] = []
    for name, value in values.items():
        for label, owner in _owned(name, value):
            if id(owner) not in seen:
                seen.add(id(owner))
                found.append((label, owner))
    return found


class CacheLeakError(Exception):
    """A test left a cache with leaked blocks or broken invariants (raised in teardown)."""

    def __init__(self, node_id: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{node_id} left its cache unclean ({len(problems)} problems):\n{lines}")

"""A JSON object read into one of conform's records: every key known, or a clear error.

What the worker pipe, a replay file and a lock carry (a scope, a contract, an op, a
lock's stubs) is read through `check_keys` before its record is built, so an unknown key
is refused by name, never dropped. Standard library only: the worker imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def check_keys(data: Any, known: Iterable[str], where: str) -> Mapping[str, Any]:
    """`data`, once it is a mapping whose keys are all in `known` (reads it only).
    Raises ValueError naming `where`: `WHERE: expected an object, got TYPE`, or
    `WHERE: unknown keys [...]; known: a, b` (the known keys in the order given)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    names = tuple(known)
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {', '.join(names)}")
    return data

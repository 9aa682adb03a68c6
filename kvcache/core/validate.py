"""The project's one check for integer arguments, the one for retention priorities, and
the one for the names a config is built from.

An integer is an `int` or any other `numbers.Integral` (numpy integers included), never a
`bool`: `True` as a block count or a priority is a bug, not a 1. Every integer check
returns a plain `int` and raises ValueError naming the argument and the value. A config
(a dataclass) built from a mapping or from keyword options refuses a name that is not one
of its fields by name (`check_fields`), never drops it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from numbers import Integral

PRIORITY_MIN = 0
PRIORITY_MAX = 100


def check_int(value: object, where: str, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """`value` as an int within [minimum, maximum] (either bound optional).

    `where` names the argument, e.g. "KvCacheConfig.tokens_per_block". Raises ValueError.
    """
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise ValueError(f"{where} must be an int{_range(minimum, maximum)}, got {value!r}")
        value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{where} must be an int{_range(minimum, maximum)}, got {value!r}")
    return value


def check_positive_int(value: object, where: str) -> int:
    """`value` as an int >= 1; ValueError naming `where` otherwise."""
    return check_int(value, where, 1)


def check_priority(value: object, where: str) -> int:
    """A retention priority: an int in [0, 100] (TensorRT-LLM's range; 35 by default)."""
    if type(value) is int and PRIORITY_MIN <= value <= PRIORITY_MAX:
        return value  # the hot path: one type check, one comparison
    return check_int(value, f"{where}: priority", PRIORITY_MIN, PRIORITY_MAX)


def check_fields(names: Iterable[str], config: type, where: str, *,
                 options: bool = False) -> None:
    """Refuse the `names` that are not fields of the dataclass `config`, naming them (sorted),
    `where` and the fields (sorted); reads only. Keys of a mapping read at `where` raise
    ValueError `WHERE: unknown CONFIG keys [...]; known keys are [...]`; with `options`,
    keyword options of the call `where` raise TypeError, as Python does for an unexpected
    keyword: `WHERE() got unknown options [...]; the options are CONFIG's fields: [...]`."""
    known = {f.name for f in fields(config)}
    unknown = sorted(set(names) - known)
    if not unknown:
        return
    name = config.__name__
    if options:
        raise TypeError(f"{where}() got unknown options {unknown}; the options are "
                        f"{name}'s fields: {sorted(known)}")
    raise ValueError(f"{where}: unknown {name} keys {unknown}; known keys are {sorted(known)}")


def _range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""

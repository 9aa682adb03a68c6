"""A block's condition checked against a description, key by key, with a reason for each.

A description is what TensorRT-LLM's `trt-test-db --match` reads: a mapping of the
machine's sysinfo keys (`gpu`, `system_gpu_count`, `linux_distribution_name`,
`compute_capability`, `supports_fp8`, ...) and the job's terms (`stage`, `backend`,
`orchestrator`, `auto_trigger`, ...). A `Machine` is turned into one by
`Machine.description()`; `kvharness test-db` reads one from JSON. Every key works the
same way whoever wrote it:

- `terms`: the description's value equals the block's (booleans and `"true"`/`"false"`
  alike, numbers and their text alike); `attention_backend` is the one term this harness
  interprets: the description holds the run's usable attention backends, and the block's
  must be among them.
- `ranges`: inclusive bounds on a number, given as a number or as its text (`"4"`).
- `wildcards`: case-insensitive globs, a list meaning any of them.

A key the description lacks (or holds as null) fails the block when `exact` (what
`--match-exact` and this harness's own runs do), and is ignored when not (`--match`,
TensorRT-LLM CI's form).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from harness.lists.hardware import HARNESS_KEYS
from harness.lists.schema import ATTENTION_BACKEND, ConditionModel

Scalar = str | bool | int | float
Description = Mapping[str, Any]


class Check(NamedTuple):
    """One condition key checked against a description, with a sentence saying why."""

    key: str
    passed: bool
    detail: str


def _absent(key: str, what: str, exact: bool) -> Check:
    if exact:
        hint = f" (a job term: --job {key}=VALUE)" if what == "machine" and (
            key not in HARNESS_KEYS) else ""
        return Check(key, False, f"the {what} has no {key!r}{hint}")
    return Check(key, True, f"the {what} has no {key!r}: ignored (--match)")


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _text(value: Any) -> str:
    """A scalar as terms and wildcards compare it: booleans as true/false (also when
    written "True"), anything else as its text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower()
    return str(value)


def _same(wanted: Scalar, value: Any) -> bool:
    if isinstance(wanted, int | float) and not isinstance(wanted, bool):
        number = _number(value)
        return number is not None and number == float(wanted)
    return _text(wanted) == _text(value)


@dataclass(frozen=True)
class Range:
    """`ranges.<key>`: inclusive bounds on a number, None meaning unbounded."""

    key: str
    gte: int | None
    lte: int | None

    def check(self, description: Description, exact: bool = True, what: str = "machine") -> Check:
        """The verdict for `description` (see the module doc for absent keys)."""
        raw = description.get(self.key)
        if raw is None:
            return _absent(self.key, what, exact)
        low = "0" if self.gte is None else str(self.gte)
        high = "inf" if self.lte is None else str(self.lte)
        label = "gpu count" if self.key == "system_gpu_count" else self.key
        value = _number(raw)
        if value is None:
            return Check(self.key, False, f"{label} {raw!r} is not a number")
        inside = (self.gte is None or value >= self.gte) and (self.lte is None or value <= self.lte)
        shown = int(value) if value.is_integer() else value
        return Check(self.key, inside, f"{label} {shown} {'in' if inside else 'outside'} "
                     f"[{low}, {high}]")

    def intersects(self, other: Range) -> bool:
        """True if some value satisfies both ranges (of one key)."""
        low = max(self.gte or 0, other.gte or 0)
        highs = [h for h in (self.lte, other.lte) if h is not None]
        return not highs or low <= min(highs)


@dataclass(frozen=True)
class Wildcard:
    """`wildcards.<key>`: globs matched case-insensitively against the description's value."""

    key: str
    patterns: tuple[str, ...]

    def check(self, description: Description, exact: bool = True, what: str = "machine") -> Check:
        """The verdict for `description` (see the module doc for absent keys)."""
        raw = description.get(self.key)
        if raw is None:
            return _absent(self.key, what, exact)
        value = raw if isinstance(raw, str) else _text(raw)
        hit = next((p for p in self.patterns if fnmatch.fnmatchcase(value.lower(), p.lower())), None)
        if hit is not None:
            return Check(self.key, True, f"{self.key} {value!r} matches {hit!r}")
        return Check(self.key, False, f"{self.key} {value!r} matches none of {list(self.patterns)}")


@dataclass(frozen=True)
class Term:
    """`terms.<key>`: the description's value equals `value` (`attention_backend`: is
    among the description's backends)."""

    key: str
    value: Scalar

    def check(self, description: Description, exact: bool = True, what: str = "machine") -> Check:
        """The verdict for `description` (see the module doc for absent keys)."""
        raw = description.get(self.key)
        if raw is None:
            return _absent(self.key, what, exact)
        wanted = _text(self.value)
        if self.key == ATTENTION_BACKEND and isinstance(raw, list | tuple):
            ok = self.value in raw
            verb = "is" if ok else "is not"
            return Check(self.key, ok, f"attention backend {self.value} {verb} among this run's "
                         f"backends ({', '.join(map(str, raw))})")
        ok = _same(self.value, raw)
        return Check(self.key, ok, f"{self.key} {_text(raw)}" + ("" if ok else f", block wants "
                                                                  f"{wanted}"))


@dataclass(frozen=True)
class Condition:
    """A block's condition: every key present must hold (terms, ranges, wildcards)."""

    terms: tuple[Term, ...] = ()
    ranges: tuple[Range, ...] = ()
    wildcards: tuple[Wildcard, ...] = ()

    @classmethod
    def from_model(cls, cond: ConditionModel) -> Condition:
        """The condition a validated block states, keys in the file's order."""
        return cls(
            tuple(Term(k, v) for k, v in (cond.terms or {}).items()),
            tuple(Range(k, r.gte, r.lte) for k, r in (cond.ranges or {}).items()),
            tuple(Wildcard(k, tuple(g)) for k, g in (cond.wildcards or {}).items()))

    def term(self, key: str) -> Scalar | None:
        """The value the block's `terms.<key>` states, or None."""
        return next((t.value for t in self.terms if t.key == key), None)

    def checks(self, description: Description, exact: bool = True,
               what: str = "machine") -> tuple[Check, ...]:
        """Each key's verdict, in the order terms, ranges, wildcards. `what` names the
        description in the sentence of an absent key ("machine", "description")."""
        return (*(t.check(description, exact, what) for t in self.terms),
                *(r.check(description, exact, what) for r in self.ranges),
                *(w.check(description, exact, what) for w in self.wildcards))

    def matches(self, description: Description, exact: bool = True) -> bool:
        """True if every key holds for `description`."""
        return all(c.passed for c in self.checks(description, exact))

    def may_overlap(self, other: Condition) -> bool:
        """True unless the two can never hold for one description: a term both state with
        different values, or ranges of one key that do not intersect (wildcards count as
        overlapping)."""
        mine = {t.key: _text(t.value) for t in self.terms}
        if any(t.key in mine and mine[t.key] != _text(t.value) for t in other.terms):
            return False
        ranges = {r.key: r for r in self.ranges}
        return all(r.key not in ranges or ranges[r.key].intersects(r) for r in other.ranges)

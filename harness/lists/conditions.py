"""A block's condition checked against a machine, key by key, with a reason for each.

Keys are TensorRT-LLM's test-db keys that mean something here: `terms` (stage, backend,
orchestrator, supports_*), `ranges.system_gpu_count`, and `wildcards` (gpu, cpu,
linux_distribution_name, compute_capability). The schema rejects every other key.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import NamedTuple

from harness.lists.hardware import Backend, Machine, Orchestrator, Stage
from harness.lists.schema import ConditionModel


class Check(NamedTuple):
    """One condition key checked against a machine, with a sentence saying why."""

    key: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class GpuCountRange:
    """`ranges.system_gpu_count`: inclusive bounds, None meaning unbounded."""

    gte: int | None
    lte: int | None

    def check(self, machine: Machine) -> Check:
        low = "0" if self.gte is None else str(self.gte)
        high = "inf" if self.lte is None else str(self.lte)
        inside = (self.gte is None or machine.gpu_count >= self.gte) and (
            self.lte is None or machine.gpu_count <= self.lte)
        word = "in" if inside else "outside"
        return Check("system_gpu_count", inside, f"gpu count {machine.gpu_count} {word} [{low}, {high}]")

    def intersects(self, other: GpuCountRange) -> bool:
        """True if some gpu count satisfies both ranges."""
        low = max(self.gte or 0, other.gte or 0)
        highs = [h for h in (self.lte, other.lte) if h is not None]
        return not highs or low <= min(highs)


def _machine_value(machine: Machine, key: str) -> str:
    values = {"gpu": machine.gpu, "cpu": machine.cpu_arch,
              "linux_distribution_name": machine.distribution,
              "compute_capability": machine.compute_capability or "none"}
    return values[key]


@dataclass(frozen=True)
class Wildcard:
    """`wildcards.<key>`: globs matched case-insensitively against the machine's value."""

    key: str  # a WildcardsModel field
    patterns: tuple[str, ...]

    def check(self, machine: Machine) -> Check:
        value = _machine_value(machine, self.key)
        hit = next((p for p in self.patterns if fnmatch.fnmatchcase(value.lower(), p.lower())), None)
        if hit is not None:
            return Check(self.key, True, f"{self.key} {value!r} matches {hit!r}")
        return Check(self.key, False, f"{self.key} {value!r} matches none of {list(self.patterns)}")


@dataclass(frozen=True)
class Condition:
    """A block's condition: every present key must hold (terms, ranges, wildcards)."""

    stage: Stage
    backend: Backend | None
    gpu_count: GpuCountRange | None
    wildcards: tuple[Wildcard, ...]
    orchestrator: Orchestrator | None = None
    features: tuple[tuple[str, bool], ...] = ()  # (supports_x, wanted)

    @classmethod
    def from_model(cls, cond: ConditionModel) -> Condition:
        """The condition a validated block states."""
        rng = cond.ranges.system_gpu_count if cond.ranges is not None else None
        wild = cond.wildcards
        wildcards = () if wild is None else tuple(
            Wildcard(key, tuple(globs)) for key in type(wild).model_fields
            if (globs := getattr(wild, key)) is not None)
        return cls(cond.terms.stage, cond.terms.backend,
                   None if rng is None else GpuCountRange(rng.gte, rng.lte), wildcards,
                   cond.terms.orchestrator, tuple(cond.terms.features().items()))

    def checks(self, machine: Machine) -> tuple[Check, ...]:
        """Each key's verdict, in the order terms, ranges, wildcards."""
        stage_ok = self.stage == machine.stage
        out = [Check("stage", stage_ok, f"stage {machine.stage}" + (
            "" if stage_ok else f", block wants {self.stage}"))]
        if self.backend is not None:
            ok = self.backend in machine.backends
            verb = "is" if ok else "is not"
            out.append(Check("backend", ok, f"backend {self.backend} {verb} among this run's "
                             f"backends ({', '.join(machine.backends)})"))
        if self.orchestrator is not None:
            ok = self.orchestrator == machine.orchestrator
            out.append(Check("orchestrator", ok, f"orchestrator {machine.orchestrator}" + (
                "" if ok else f", block wants {self.orchestrator}")))
        have = machine.features
        cc = machine.compute_capability or "none"
        for name, wanted in self.features:
            out.append(Check(name, have[name] == wanted, f"{name} is {str(have[name]).lower()} "
                             f"(compute capability {cc}), block wants {str(wanted).lower()}"))
        if self.gpu_count is not None:
            out.append(self.gpu_count.check(machine))
        out.extend(w.check(machine) for w in self.wildcards)
        return tuple(out)

    def matches(self, machine: Machine) -> bool:
        """True if every key holds for `machine`."""
        return all(c.passed for c in self.checks(machine))

    def may_overlap(self, other: Condition) -> bool:
        """True unless the two can never hold on one machine (wildcards count as overlapping)."""
        if self.stage != other.stage:
            return False
        if None not in (self.backend, other.backend) and self.backend != other.backend:
            return False
        if None not in (self.orchestrator, other.orchestrator) and (
                self.orchestrator != other.orchestrator):
            return False
        wanted = dict(self.features)
        if any(wanted.get(name, value) != value for name, value in other.features):
            return False
        if self.gpu_count is None or other.gpu_count is None:
            return True
        return self.gpu_count.intersects(other.gpu_count)

"""Every check `kvharness conform` runs, in order: the scenario families
(`families.CHECKS`), those judged against the contract's documented policies
(`policy_families.CHECKS`: eviction order, preemption, the scheduler's chunks, event
fields, sliding windows), then those that open the cache with a host tier or a hybrid
model's recurrent state (`layout_families.CHECKS`)."""

from __future__ import annotations

from harness.conform.controller import families, layout_families, policy_families
from harness.conform.controller.families import Check

CHECKS: tuple[Check, ...] = families.CHECKS + policy_families.CHECKS + layout_families.CHECKS


def check_named(name: str) -> Check:
    """The check called `name`; ValueError listing the names otherwise."""
    for check in CHECKS:
        if check.name == name:
            return check
    raise ValueError(f"unknown check {name!r}; known: {[c.name for c in CHECKS]}")

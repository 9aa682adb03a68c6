"""What a scenario ran on one engine, JSON-ready: how to build the engine (`EngineRecipe`),
each call it made in order (`Call`), and what the cache saw and counted (`EngineRun`).

A recipe names the model by preset (or by the `module:function` that builds it from the
seed) and seed, the engine class (None: kvcache's Engine; else `module:QualName` of a
subclass, such as a test's fault-injecting one), the attention backend by registry name
or by `module:QualName` (a test's backend outside kvcache's registry), the device and
dtype, the KvCacheConfig as given (None: "auto") and every other EngineConfig field
resolved to its value (`EngineConfig.as_dict`: layout, page size, chunking, budget, graph
and padding flags, ...; a re-run rebuilds it with `EngineConfig.from_dict`). Every
name is looked up in harness.repro.registry, never imported from the file; the sizes a
recipe and its calls ask for are bounded (harness.repro.fileformat's limits). Calls are the engine's request API:
`generate` (a batch run to completion), `add_request`, `step`, `abort`; each keeps the
phase the scenario was in (cold, warm, reference, ...) and the request ids it returned,
so a replay can tell a diverging schedule from a diverging output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from harness.repro.fileformat import (
    LIMITS,
    MAX_BATCH,
    MAX_POOL_TOKENS,
    Fields,
)

Op = Literal["generate", "add_request", "step", "abort"]
OPS: tuple[Op, ...] = ("generate", "add_request", "step", "abort")
# A scope as JSON: None (the default scope) or {"salt": str | int | {"hex": ...}, "lora_id"}.
ScopeJson = dict[str, Any] | None


@dataclass(frozen=True)
class EngineRecipe:
    """Everything `Engine(...)` was built from: `preset` is a preset name or the
    `module:function` that builds the model from `model_seed`; `engine` is None for
    kvcache's Engine, else the `module:QualName` of the Engine subclass; `options` the
    EngineConfig's dict form without the fields kept here (backend, device, dtype, and
    its seed: `model_seed`)."""

    preset: str
    model_seed: int
    engine: str | None
    backend: str
    device: str
    dtype: str
    cache: dict[str, Any]
    options: dict[str, Any]

    @classmethod
    def from_fields(cls, f: Fields) -> EngineRecipe:
        """Parse; raises ReproFormatError naming the field (a pool or a batch beyond the
        limits of harness.repro.fileformat included)."""
        cache, options = f.sub("cache"), f.sub("options")
        cache.pools(required=True)
        _check_sizes(options)
        recipe = cls(f.get("preset", str), f.bounded("model_seed", 0, 2**63 - 1),
                     f.get("engine", str, optional=True), f.get("backend", str),
                     f.get("device", str), f.get("dtype", str), cache.data, options.data)
        f.close()
        return recipe


def _check_sizes(options: Fields) -> None:
    """Bound the Engine options that size what the engine allocates (the others Engine()
    checks)."""
    for name, high in (("max_num_tokens", LIMITS["tokens"]), ("max_batch_size", MAX_BATCH),
                       ("page_size", MAX_POOL_TOKENS)):
        if name in options.data:
            options.bounded(name, 1, high, optional=name == "page_size")
    if "graph_batch_sizes" in options.data:
        sizes = options.ints("graph_batch_sizes") or []
        if len(sizes) > MAX_BATCH or any(not 1 <= n <= MAX_BATCH for n in sizes):
            raise options.error("graph_batch_sizes", f"must hold at most {MAX_BATCH} sizes, "
                                f"each in [1, {MAX_BATCH}]")


@dataclass(frozen=True)
class Call:
    """One call on the engine. generate: `prompts`, `max_new_tokens`, `scopes`,
    `force_tokens`; add_request: the same for one prompt, with `priority`; step: none;
    abort: `rids[0]`. `rids`: the request ids it returned (generate, add_request), or
    finished (step), or aborted (abort)."""

    op: Op
    phase: str
    rids: list[int]
    prompts: list[list[int]] = field(default_factory=list)
    max_new_tokens: int | None = None
    scopes: list[ScopeJson] | None = None
    force_tokens: list[list[int]] | None = None
    priority: int | None = None
    return_logits: bool = True

    @classmethod
    def from_fields(cls, f: Fields) -> Call:
        """Parse; raises ReproFormatError naming the field."""
        op: Op = f.choice("op", OPS)  # type: ignore[assignment]
        scopes = f.get("scopes", list, optional=True)
        call = cls(op, f.get("phase", str), f.ints("rids") or [],
                   f.token_lists("prompts") or [],
                   f.bounded("max_new_tokens", 0, LIMITS["new tokens"], optional=True), scopes,
                   f.token_lists("force_tokens", optional=True),
                   f.get("priority", int, optional=True), f.get("return_logits", bool))
        f.close()
        if op in ("generate", "add_request") and (not call.prompts or call.max_new_tokens is None):
            raise f.error("prompts", f"and max_new_tokens are required by a {op} call")
        if op == "add_request" and len(call.prompts) != 1:
            raise f.error("prompts", f"holds {len(call.prompts)} prompts; add_request takes one")
        if len(call.prompts) > MAX_BATCH:
            raise f.error("prompts", f"holds {len(call.prompts)} prompts; a re-run allows "
                          f"{MAX_BATCH} in one call")
        if op == "abort" and len(call.rids) != 1:
            raise f.error("rids", "of an abort call must hold the one aborted request id")
        f.spend("max_new_tokens", "new tokens", len(call.prompts) * (call.max_new_tokens or 0))
        for i, scope in enumerate(scopes or ()):
            if not _is_scope(scope):
                raise f.error("scopes", f"item {i} must be null or {{salt, lora_id}} (salt "
                              "null, a str, an int or {hex: str}; lora_id null or an int "
                              f">= 0), got {json.dumps(scope)[:80]}")
        return call


def _is_scope(scope: Any) -> bool:
    """Whether `scope` is a scope's JSON form (see `scope_json`)."""
    if scope is None:
        return True
    if not isinstance(scope, dict) or set(scope) != {"salt", "lora_id"}:
        return False
    salt, lora = scope["salt"], scope["lora_id"]
    if isinstance(salt, dict):
        salt_ok = set(salt) == {"hex"} and isinstance(salt["hex"], str) and _is_hex(salt["hex"])
    else:
        salt_ok = salt is None or isinstance(salt, str) or (
            isinstance(salt, int) and not isinstance(salt, bool))
    lora_ok = lora is None or (isinstance(lora, int) and not isinstance(lora, bool)
                               and lora >= 0)
    return salt_ok and lora_ok


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class EngineRun:
    """One engine of the scenario: its recipe, its calls in order, and, when the record
    was written, its cache's admission log, its cumulative counters and the oracle's
    prediction of them (None where it could not be computed)."""

    recipe: EngineRecipe
    calls: list[Call]
    admission_log: list[dict[str, Any]]
    counters: dict[str, int | float]
    predicted: dict[str, int | float] | None

    @classmethod
    def from_fields(cls, f: Fields) -> EngineRun:
        """Parse; raises ReproFormatError naming the field."""
        run = cls(EngineRecipe.from_fields(f.sub("recipe")),
                  [Call.from_fields(c) for c in f.subs("calls", "calls")],
                  f.admission_log("admission_log") or [], f.get("counters", dict),
                  f.get("predicted", dict, optional=True))
        f.close()
        return run


def scope_json(salt: Any, lora_id: int | None) -> ScopeJson:
    """A scope's JSON form (None for the default scope; bytes salts as hex)."""
    if salt is None and lora_id is None:
        return None
    return {"salt": {"hex": salt.hex()} if isinstance(salt, bytes) else salt,
            "lora_id": lora_id}


def scope_args(scope: ScopeJson) -> tuple[Any, int | None] | None:
    """(salt, lora_id) of a scope's JSON form, None for the default scope."""
    if scope is None:
        return None
    salt = scope["salt"]
    if isinstance(salt, dict):
        salt = bytes.fromhex(salt["hex"])
    return salt, scope["lora_id"]

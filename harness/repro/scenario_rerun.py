"""Re-run a ScenarioRecord: rebuild each engine from its recipe, make its calls in the
recorded order (cold, then warm, as the scenario ran them), and check again.

The recorded failure is checked first: outputs compared again with the same tolerance,
reuse against the oracle's replay of the new admission log, or full blocks against its
unbounded bound. Then, what the scenario would check next: each engine's reuse against
the oracle (exact where its pool evicted nothing, else the full-blocks bound).
Differences from the recording that are not failures (another schedule, other counters:
a fix may change both) are reported as notes.

A recipe's model, backend and engine class are looked up in harness.repro.registry,
every engine's before the first is built: a file selects among the harness's names and
never names code to import.

Like harness.repro.reuse_replay, this loads `kvcache` (and torch) inside its functions only: a
scenario record is a recording of kvcache's Engine (docs/architecture.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from harness.oracle.types import DEFAULT_PRIORITY
from harness.repro.compare import describe, first_difference
from harness.repro.fileformat import ReproFormatError
from harness.repro.outcome import Outcome
from harness.repro.registry import Resolved, resolve
from harness.repro.scenario_record import (
    FullBlocksFailure,
    OracleFailure,
    OutputRef,
    ScenarioRecord,
)
from harness.repro.workload import Call, EngineRecipe, EngineRun, scope_args
from harness.reuse.adapters import KvcacheEngineAdapter
from harness.reuse.assertions import (
    ReuseMismatch,
    expect_full_blocks_bounded,
    expect_matches_oracle,
    predict_from_engine,
)

if TYPE_CHECKING:
    from kvcache import Engine, GenerationOutput

def build(recipe: EngineRecipe, resolved: Resolved, where: str) -> Engine:
    """The engine `recipe` describes, from what its names stand for (`resolved`, from
    harness.repro.registry.resolve); its options are an EngineConfig's dict form, rebuilt
    with `EngineConfig.from_dict`. Raises ReproFormatError naming `where` when it cannot
    be built here (an unknown or bad option, a bad cache field)."""
    from kvcache import EngineConfig, KvCacheConfig

    try:
        cache = KvCacheConfig(**recipe.cache)
        doubled = sorted(set(recipe.options) & {"seed", "attn_backend", "device", "dtype"})
        if doubled:
            raise ValueError(f"options: {doubled} belong in the recipe's own fields "
                             "(model_seed, backend, device, dtype)")
        config = EngineConfig.from_dict(
            {**recipe.options, "seed": recipe.model_seed, "attn_backend": resolved.backend,
             "device": resolved.device, "dtype": resolved.dtype}, "options")
        model = resolved.model
        if not isinstance(model, str):
            model = model(recipe.model_seed)
        return resolved.engine_class(model, cache, config)
    except (TypeError, ValueError) as exc:
        raise ReproFormatError(f"{where}: the engine cannot be built: {exc}") from None


def _scopes(scopes: Sequence[Any] | None) -> list[Any] | None:
    from kvcache import ReuseScope

    if scopes is None:
        return None
    return [None if (a := scope_args(s)) is None else ReuseScope(*a) for s in scopes]


def _call(engine: Engine, call: Call) -> tuple[list[int], list[GenerationOutput]]:
    """Make `call`; returns the request ids it gave and the outputs it returned."""
    scopes = _scopes(call.scopes)
    if call.op == "generate":
        assert call.max_new_tokens is not None
        outs = engine.generate(call.prompts, call.max_new_tokens, scopes,
                               return_logits=call.return_logits, force_tokens=call.force_tokens)
        return [o.request_id for o in outs], outs
    if call.op == "add_request":
        assert call.max_new_tokens is not None
        priority = {} if call.priority is None else {"priority": call.priority}
        rid = engine.add_request(
            call.prompts[0], call.max_new_tokens, scopes[0] if scopes else None, **priority,
            force_tokens=call.force_tokens[0] if call.force_tokens else None,
            return_logits=call.return_logits)
        return [rid], []
    outs = engine.step() if call.op == "step" else [engine.abort(call.rids[0])]
    return [o.request_id for o in outs], outs


def resolve_recipe(recipe: EngineRecipe, where: str) -> Resolved:
    """What `recipe`'s names stand for (harness.repro.registry.resolve); raises
    ReproFormatError naming `where` and the field for a name outside the registry."""
    return resolve(recipe.preset, recipe.engine, recipe.backend, recipe.device, recipe.dtype,
                   where)


def run_engine(index: int, run: EngineRun, resolved: Resolved, notes: list[str],
               file: str = "record") -> tuple[Engine, dict[int, GenerationOutput]]:
    """Build engine `index` of the record in `file` from `resolved` (its recipe's names,
    see `resolve_recipe`) and make its calls; returns it and its outputs by request id.
    A schedule or counters unlike the recording's are added to `notes`. Raises
    ReproFormatError as `build` does, and for a call the engine refuses (a ValueError:
    the error names the call)."""
    where = f"engines[{index}]"
    engine = build(run.recipe, resolved, f"{file}: {where}.recipe")
    outputs: dict[int, GenerationOutput] = {}
    for k, call in enumerate(run.calls):
        try:
            rids, outs = _call(engine, call)
        except ValueError as exc:
            raise ReproFormatError(f"{file}: {where}.calls[{k}] ({call.op}, {call.phase}): "
                                   f"the engine refused it: {exc}") from None
        outputs.update((o.request_id, o) for o in outs)
        if rids != call.rids:
            notes.append(f"{where}.calls[{k}] ({call.op}, {call.phase}): request ids {rids}, "
                         f"recorded {call.rids}")
    log = [_plain(e) for e in engine.admission_log()]
    recorded = [_with_priority(e) for e in run.admission_log]
    if log != recorded:
        at = next((i for i, (a, b) in enumerate(zip(log, recorded, strict=False))
                   if a != b), min(len(log), len(recorded)))
        notes.append(f"{where}: the cache saw another sequence of operations from event {at} "
                     f"({len(log)} events, {len(recorded)} recorded)")
    counters = engine.kv_cache_stats().as_dict()
    changed = sorted(k for k, v in run.counters.items() if counters.get(k) != v)
    if changed:
        notes.append(f"{where}: counters differ from the recording: " + ", ".join(
            f"{k} {counters.get(k)} (recorded {run.counters[k]})" for k in changed))
    return engine, outputs


def _plain(event: dict[str, Any]) -> Any:
    return json.loads(json.dumps(event))


def _with_priority(event: Any) -> Any:
    """A recorded event as the log writes it now: an admit recorded before the log
    carried priorities gets the default one, which is what those runs used unless a
    call said otherwise."""
    if isinstance(event, dict) and event.get("kind") == "admit" and "priority" not in event:
        return {**event, "priority": DEFAULT_PRIORITY}
    return event


def _pick(refs: Sequence[OutputRef], outputs: list[dict[int, GenerationOutput]]
          ) -> list[GenerationOutput]:
    missing = [ref for ref in refs if ref[1] not in outputs[ref[0]]]
    if missing:
        raise ReproFormatError(f"the re-run produced no output for [engine, request] {missing} "
                               "(the engine now schedules differently: see the notes)")
    return [outputs[e][rid] for e, rid in refs]


def _oracle(engine: Engine, exact: bool, bounded: bool,
            results: Sequence[GenerationOutput]) -> str | None:
    """The oracle check's failure message, None when it holds."""
    adapter = KvcacheEngineAdapter(engine)
    try:
        expect_matches_oracle(adapter, predict_from_engine(adapter, bounded=bounded), exact,
                              results=list(results), tree_dump=engine.manager.state.tree.dump)
    except ReuseMismatch as exc:
        return str(exc)
    return None


def _full_blocks(engine: Engine, results: Sequence[GenerationOutput]) -> str | None:
    """The full-blocks bound's failure message, None when it holds."""
    try:
        expect_full_blocks_bounded(KvcacheEngineAdapter(engine), results,
                                   tree_dump=engine.manager.state.tree.dump)
    except ReuseMismatch as exc:
        return str(exc)
    return None


def _admitted(engine: Engine, outputs: dict[int, GenerationOutput]
              ) -> list[GenerationOutput]:
    """The outputs of requests the cache admitted (a request aborted while it waited has
    an output but no admission: the oracle has nothing to say about it)."""
    admitted = {e["seq_id"] for e in engine.admission_log() if e["kind"] == "admit"}
    return [o for rid, o in outputs.items() if rid in admitted]


def _recorded_check(record: ScenarioRecord, engines: list[Engine],
                    outputs: list[dict[int, GenerationOutput]], notes: list[str]) -> str | None:
    """The recorded check, made again on the re-run: its failure message, or None."""
    failure = record.failure
    if isinstance(failure, OracleFailure):
        return _oracle(engines[failure.engine], failure.exact, failure.bounded,
                       _pick(failure.results, outputs))
    if isinstance(failure, FullBlocksFailure):
        return _full_blocks(engines[failure.engine], _pick(failure.results, outputs))
    diff = first_difference(_pick(failure.expected, outputs), _pick(failure.actual, outputs),
                            failure.atol)
    if diff is None:
        return None
    same = {k: v for k, v in diff.to_json().items() if k != "max_abs_diff"} == {
        k: v for k, v in failure.difference.items() if k != "max_abs_diff"}
    if not same:
        notes.append(f"recorded: {describe_json(failure.difference, failure.where)}")
    return describe(diff, failure.where)


def rerun(record: ScenarioRecord, file: str = "record") -> Outcome:
    """Re-run `record` (read from `file`, which errors name) and check again: the
    recorded failure came back (`reproduced`), it and every later check passed (`not
    reproduced`), or it is gone but another check failed (`another check failed`). Every
    engine's names are resolved before any engine is built. Raises ReproFormatError
    when it cannot be re-run here (see `run_engine`); anything the engine raises on the
    way (a RuntimeError, a MemoryError) propagates."""
    notes: list[str] = []
    resolved = [resolve_recipe(run.recipe, f"{file}: engines[{i}].recipe")
                for i, run in enumerate(record.engines)]
    built = [run_engine(i, run, names, notes, file)
             for i, (run, names) in enumerate(zip(record.engines, resolved, strict=True))]
    engines = [engine for engine, _ in built]
    outputs = [outs for _, outs in built]
    message = _recorded_check(record, engines, outputs, notes)
    if message is not None:
        return Outcome("reproduced", message, tuple(notes))
    for i, engine in enumerate(engines):
        results = _admitted(engine, outputs[i])
        evicted = engine.kv_cache_stats().evicted_blocks
        if evicted:
            notes.append(f"engines[{i}]: reuse checked against the full-blocks bound, not the "
                         f"exact oracle: its pool evicted {evicted} blocks")
            message = _full_blocks(engine, results)
        else:
            message = _oracle(engine, True, False, results)
        if message is not None:
            return Outcome("another check failed", f"engines[{i}]: {message}", tuple(notes))
    return Outcome("not reproduced", f"{record.failure.check} check holds now, and reuse "
                   "matches the oracle", tuple(notes))


def describe_json(difference: dict[str, Any], where: str) -> str:
    """`compare.describe` of a recorded difference; a malformed one is shown raw."""
    from harness.repro.compare import Difference

    try:
        return describe(Difference(**difference), where)
    except TypeError:
        return f"{where}: {difference}"

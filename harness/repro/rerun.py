"""Re-run a ScenarioRecord: rebuild each engine from its recipe, make its calls in the
recorded order (cold, then warm, as the scenario ran them), and check again.

The recorded failure is checked first: outputs compared again with the same tolerance,
or reuse against the oracle's replay of the new admission log. Then, what the scenario
would check next: each engine's reuse against the oracle (exact, where its pool evicted
nothing). Differences from the recording that are not failures (another schedule, other
counters: a fix may change both) are reported as notes.

Like harness.reuse.replay, this loads `kvcache` (and torch) inside its functions only: a
scenario record is a recording of kvcache's Engine (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from harness.adapters import KvcacheEngineAdapter
from harness.repro.compare import describe, first_difference
from harness.repro.fileformat import ReproFormatError
from harness.repro.record import OracleFailure, OutputRef, ScenarioRecord
from harness.repro.workload import Call, EngineRecipe, EngineRun, scope_args
from harness.reuse.assertions import ReuseMismatch, expect_matches_oracle, predict_from_engine

if TYPE_CHECKING:
    from kvcache import Engine, GenerationOutput

Status = Literal["reproduced", "gone", "other"]


class Rerun(NamedTuple):
    """What the re-run found: the recorded failure came back (`reproduced`), it and every
    later check passed (`gone`), or it is gone but another check failed (`other`)."""

    status: Status
    message: str
    notes: list[str]


def backend_ref(backend: Any) -> str:
    """A recipe's backend: the registry name, or `module:QualName` for a class outside it."""
    if isinstance(backend, str):
        return backend
    return f"{backend.__module__}:{backend.__qualname__}"


def _backend(ref: str, where: str) -> Any:
    if ":" not in ref:
        return ref  # a registry name: Engine() checks it and lists the known ones
    module, _, name = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ReproFormatError(f"{where}: backend {ref!r} cannot be imported ({exc}); run "
                               "from the repository that defines it") from None
    return obj


def build(recipe: EngineRecipe, where: str) -> Engine:
    """The engine `recipe` describes. Raises ReproFormatError naming `where` when it
    cannot be built here (bad option, unknown backend or dtype, no CUDA)."""
    import torch

    from kvcache import Engine, KvCacheConfig

    dtype = getattr(torch, recipe.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ReproFormatError(f"{where}.dtype: {recipe.dtype!r} is not a torch dtype")
    if recipe.device.startswith("cuda") and not torch.cuda.is_available():
        raise ReproFormatError(f"{where}.device: the record ran on {recipe.device!r}; this "
                               "machine has no CUDA")
    backend = _backend(recipe.backend, f"{where}.backend")
    try:
        cache = KvCacheConfig(**recipe.cache)
        return Engine(recipe.preset, cache, seed=recipe.model_seed, attn_backend=backend,
                      device=recipe.device, dtype=dtype, **recipe.options)
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


def run_engine(index: int, run: EngineRun, notes: list[str], file: str = "record"
               ) -> tuple[Engine, dict[int, GenerationOutput]]:
    """Build engine `index` of the record in `file` and make its calls; returns it and
    its outputs by request id. A schedule or counters unlike the recording's are added
    to `notes`. Raises ReproFormatError as `build` does."""
    where = f"engines[{index}]"
    engine = build(run.recipe, f"{file}: {where}.recipe")
    outputs: dict[int, GenerationOutput] = {}
    for k, call in enumerate(run.calls):
        rids, outs = _call(engine, call)
        outputs.update((o.request_id, o) for o in outs)
        if rids != call.rids:
            notes.append(f"{where}.calls[{k}] ({call.op}, {call.phase}): request ids {rids}, "
                         f"recorded {call.rids}")
    log = [_plain(e) for e in engine.admission_log()]
    if log != run.admission_log:
        at = next((i for i, (a, b) in enumerate(zip(log, run.admission_log, strict=False))
                   if a != b), min(len(log), len(run.admission_log)))
        notes.append(f"{where}: the cache saw another sequence of operations from event {at} "
                     f"({len(log)} events, {len(run.admission_log)} recorded)")
    counters = engine.kv_cache_stats().as_dict()
    changed = sorted(k for k, v in run.counters.items() if counters.get(k) != v)
    if changed:
        notes.append(f"{where}: counters differ from the recording: " + ", ".join(
            f"{k} {counters.get(k)} (recorded {run.counters[k]})" for k in changed))
    return engine, outputs


def _plain(event: dict[str, Any]) -> Any:
    return json.loads(json.dumps(event))


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
                              results=list(results), tree_dump=engine.manager.dump_tree)
    except ReuseMismatch as exc:
        return str(exc)
    return None


def rerun(record: ScenarioRecord, file: str = "record") -> Rerun:
    """Re-run `record` (read from `file`, which errors name) and check again. Raises
    ReproFormatError when it cannot be re-run here (see `build`)."""
    notes: list[str] = []
    built = [run_engine(i, run, notes, file) for i, run in enumerate(record.engines)]
    engines = [engine for engine, _ in built]
    outputs = [outs for _, outs in built]
    failure = record.failure
    if isinstance(failure, OracleFailure):
        message = _oracle(engines[failure.engine], failure.exact, failure.bounded,
                          _pick(failure.results, outputs))
        if message is not None:
            return Rerun("reproduced", message, notes)
    else:
        diff = first_difference(_pick(failure.expected, outputs),
                                _pick(failure.actual, outputs), failure.atol)
        if diff is not None:
            same = {k: v for k, v in diff.to_json().items() if k != "max_abs_diff"} == {
                k: v for k, v in failure.difference.items() if k != "max_abs_diff"}
            if not same:
                notes.append(f"recorded: {describe_json(failure.difference, failure.where)}")
            return Rerun("reproduced", describe(diff, failure.where), notes)
    for i, engine in enumerate(engines):
        evicted = engine.kv_cache_stats().evicted_blocks
        if evicted:
            notes.append(f"engines[{i}]: reuse not checked against the exact oracle: its pool "
                         f"evicted {evicted} blocks")
            continue
        message = _oracle(engine, True, False, list(outputs[i].values()))
        if message is not None:
            return Rerun("other", f"engines[{i}]: {message}", notes)
    return Rerun("gone", f"{failure.check} check holds now, and reuse matches the oracle",
                 notes)


def describe_json(difference: dict[str, Any], where: str) -> str:
    """`compare.describe` of a recorded difference; a malformed one is shown raw."""
    from harness.repro.compare import Difference

    try:
        return describe(Difference(**difference), where)
    except TypeError:
        return f"{where}: {difference}"

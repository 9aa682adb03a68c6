"""Scenario engines that record what they run, so a failed check writes a repro file
that `kvharness repro` re-runs without pytest (harness.repro).

`RecordedEngine` is kvcache's Engine (or, through `recorded`, a subclass of it, such as
a fault-injecting one), unchanged, that also keeps its recipe (every option it was built
with) and each call of its request API in order, tagged with the scenario's phase (cold,
warm, reference, ...). Its outputs are `RecordedOutput`s: the
same GenerationOutput plus the engine that produced it, so a failed comparison of two
output lists knows which engines and requests to re-run. `outputs_record` and
`check_record` build the ScenarioRecord a failed check carries as `.repro` (the harness
plugin writes it to `<results-dir>/repro/<test id>.json`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from harness.repro.compare import Difference
from harness.repro.registry import object_ref
from harness.repro.scenario_record import Failure, OutputRef, OutputsFailure, ScenarioRecord
from harness.repro.workload import Call, EngineRecipe, EngineRun, Op, scope_json
from harness.reuse.adapters import KvcacheEngineAdapter
from harness.reuse.assertions import predict_from_engine
from kvcache import Engine, EngineConfig, GenerationOutput, KvCacheConfig, ReuseScope

# EngineConfig fields a recipe keeps apart (backend, device, dtype) or that build the
# model (seed: the recipe's model_seed); the rest are its `options`.
_APART = ("attn_backend", "device", "dtype", "seed")


class OutputMismatch(AssertionError):
    """Two runs' outputs differ; `repro` is the ScenarioRecord to write, when every
    output came from a RecordedEngine."""

    def __init__(self, message: str, repro: ScenarioRecord | None) -> None:
        super().__init__(message)
        self.repro = repro


@dataclass(frozen=True)
class RecordedOutput(GenerationOutput):
    """A GenerationOutput that knows the engine it came from."""

    engine: RecordedEngine | None = field(default=None, repr=False, compare=False)


class RecordedEngine(Engine):
    """An Engine that records its recipe and calls. `preset` names the model (a preset or
    the `module:function` that built it from `model_seed`); `phase` tags the calls made
    until it is changed; `serial` orders the test's engines; `node_id` is the test's id."""

    def __init__(self, model: Any, cache_config: KvCacheConfig,
                 engine_config: EngineConfig | None = None, *, preset: str, model_seed: int,
                 node_id: str, serial: int, **options: Any) -> None:
        super().__init__(model, cache_config, engine_config, **options)
        # the Engine class under the recording: kvcache's, or a subclass (see `recorded`)
        base = next(c for c in type(self).__mro__
                    if issubclass(c, Engine) and not issubclass(c, RecordedEngine))
        recipe_options = self.config.as_dict()  # every option, resolved to its value
        apart = {name: recipe_options.pop(name) for name in _APART}
        self.recipe = EngineRecipe(
            preset, model_seed, None if base is Engine else object_ref(base),
            object_ref(apart["attn_backend"]), apart["device"], apart["dtype"],
            {f.name: getattr(cache_config, f.name) for f in fields(KvCacheConfig)},
            _plain(recipe_options))
        self.calls: list[Call] = []
        self.phase = "run"
        self.node_id = node_id
        self.serial = serial
        self._inside_generate = False  # generate's own add_request calls are not calls

    def _record(self, op: Op, rids: list[int], **args: Any) -> None:
        self.calls.append(Call(op, self.phase, rids, **args))

    def _wrap(self, outs: Sequence[GenerationOutput]) -> list[GenerationOutput]:
        return [RecordedOutput(**{f.name: getattr(o, f.name) for f in fields(GenerationOutput)},
                               engine=self) for o in outs]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8,
                 scopes: Sequence[ReuseScope | None] | None = None, *,
                 return_logits: bool = True,
                 force_tokens: Sequence[Sequence[int]] | None = None) -> list[GenerationOutput]:
        """Engine.generate, recorded."""
        self._inside_generate = True
        try:
            outs = super().generate(prompts, max_new_tokens, scopes, return_logits=return_logits,
                                    force_tokens=force_tokens)
        finally:
            self._inside_generate = False
        self._record("generate", [o.request_id for o in outs], prompts=_ints(prompts),
                     max_new_tokens=max_new_tokens, scopes=_scopes(scopes),
                     force_tokens=None if force_tokens is None else _ints(force_tokens),
                     return_logits=return_logits)
        return self._wrap(outs)

    def add_request(self, prompt: Sequence[int], max_new_tokens: int,
                    scope: ReuseScope | None = None, **kwargs: Any) -> int:
        """Engine.add_request, recorded (unless generate made it)."""
        rid = super().add_request(prompt, max_new_tokens, scope, **kwargs)
        if not self._inside_generate:
            forced = kwargs.get("force_tokens")
            self._record("add_request", [rid], prompts=_ints([prompt]),
                         max_new_tokens=max_new_tokens, scopes=_scopes([scope]),
                         force_tokens=None if forced is None else _ints([forced]),
                         priority=kwargs.get("priority"),
                         return_logits=kwargs.get("return_logits", True))
        return rid

    def step(self) -> list[GenerationOutput]:
        """Engine.step, recorded."""
        outs = super().step()
        self._record("step", [o.request_id for o in outs])
        return self._wrap(outs)

    def abort(self, request_id: int) -> GenerationOutput:
        """Engine.abort, recorded."""
        out = super().abort(request_id)
        self._record("abort", [int(request_id)])
        return self._wrap([out])[0]

    def run_record(self) -> EngineRun:
        """This engine as the repro file keeps it, now."""
        try:
            log = _plain(self.admission_log())
            predicted = predict_from_engine(KvcacheEngineAdapter(self)).totals.as_dict()
        except ValueError:  # record_events=False: no log, so no oracle either
            log, predicted = [], None
        return EngineRun(self.recipe, list(self.calls), log,
                         self.kv_cache_stats().as_dict(), predicted)


def recorded(engine_class: type[Engine]) -> type[RecordedEngine]:
    """The recording engine class over `engine_class` (kvcache's Engine or a subclass,
    whose `module:QualName` the recipe then names so that a replay builds it too)."""
    if engine_class is Engine:
        return RecordedEngine
    if not issubclass(engine_class, Engine):
        raise ValueError(f"engine_class must be a subclass of kvcache's Engine, got "
                         f"{engine_class!r}")
    return type(f"Recorded{engine_class.__name__}", (RecordedEngine, engine_class), {})


def _plain(value: Any) -> Any:
    """`value` as JSON round-trips it (tuples become lists)."""
    return json.loads(json.dumps(value, default=str))


def _ints(lists: Sequence[Sequence[int]]) -> list[list[int]]:
    return [[int(t) for t in tokens] for tokens in lists]


def _scopes(scopes: Sequence[ReuseScope | None] | None) -> list[Any] | None:
    if scopes is None:
        return None
    return [None if s is None else scope_json(s.salt, s.lora_id) for s in scopes]


def _refs(outputs: Sequence[GenerationOutput], index: dict[int, int]) -> list[OutputRef]:
    return [(index[id(o.engine)], o.request_id) for o in outputs
            if isinstance(o, RecordedOutput) and o.engine is not None]


def _engines(outputs: Sequence[GenerationOutput]) -> list[RecordedEngine] | None:
    """The engines behind `outputs` in creation order; None if one is unrecorded."""
    engines = {}
    for o in outputs:
        if not isinstance(o, RecordedOutput) or o.engine is None:
            return None
        engines[id(o.engine)] = o.engine
    return sorted(engines.values(), key=lambda e: e.serial)


def outputs_record(where: str, atol: float, expected: Sequence[GenerationOutput],
                   actual: Sequence[GenerationOutput], difference: Difference,
                   message: str) -> ScenarioRecord | None:
    """The record of a failed output comparison; None when an output is unrecorded."""
    engines = _engines([*expected, *actual])
    if not engines:
        return None
    index = {id(e): i for i, e in enumerate(engines)}
    failure = OutputsFailure(where, atol, _refs(expected, index), _refs(actual, index),
                             difference.to_json())
    return ScenarioRecord(engines[0].node_id, message, [e.run_record() for e in engines],
                          failure)


def check_record(engine: Engine, results: Sequence[GenerationOutput], message: str,
                 failure: Callable[[int, list[OutputRef]], Failure]) -> ScenarioRecord | None:
    """The record of a failed reuse check on `engine` over `results`; `failure` makes the
    check's Failure from the engine's index in the record and the results' references.
    None when the engine or a result's engine is unrecorded."""
    if not isinstance(engine, RecordedEngine):
        return None
    engines = _engines(results) if results else []
    if engines is None:
        return None
    engines = sorted({id(e): e for e in [engine, *engines]}.values(), key=lambda e: e.serial)
    index = {id(e): i for i, e in enumerate(engines)}
    return ScenarioRecord(engine.node_id, message, [e.run_record() for e in engines],
                          failure(index[id(engine)], _refs(results, index)))

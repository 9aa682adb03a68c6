"""What every scenario family shares: backends, reuse modes, prompts, the checks and the
engine factory behind the `make_engine` fixture.

A scenario runs prompts *cold* (nothing cached that could help them), then *warm*, and
asserts (a) warm equals cold and (b) reuse equals the oracle replaying the engine's
admission log, per request and in total; every check is recorded in the run's reuse
report under the family's name. In float32 on CPU greedy tokens must be identical and
logits within 1e-5; in reduced precision the warm run is teacher-forced with the cold
run's tokens and logits are compared with a tolerance (a 1-ULP drift is normal there).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch

from harness.reports.summary import ReuseRecord, ReuseReport
from harness.repro.compare import describe, first_difference
from harness.repro.registry import object_ref
from harness.repro.reuse_record import row_dicts
from harness.repro.scenario_record import Failure, FullBlocksFailure, OracleFailure, OutputRef
from harness.reuse.adapters import KvcacheEngineAdapter
from harness.reuse.assertions import (
    ReproContext,
    ReuseMismatch,
    diff_stats,
    expect_full_blocks_bounded,
    expect_matches_oracle,
    predict_from_engine,
)
from kvcache import Engine, GenerationOutput, KvCacheConfig, KvCacheManager, ReuseScope
from kvcache.attention.base import AttentionBackend
from kvcache.model import Transformer, get_preset
from tests.scenarios.probe_replica import assert_probe_matches_admissions
from tests.scenarios.recording import (
    OutputMismatch,
    RecordedEngine,
    check_record,
    outputs_record,
    recorded,
)

VOCAB = 500  # token ids drawn from [1, VOCAB): inside every preset's vocabulary


@dataclass(frozen=True)
class BackendSpec:
    """An attention backend (a registered name, or a class: tests/scenarios/faults.py) on
    a device in a dtype, and how closely warm must match cold."""

    attn: str | type[AttentionBackend]
    device: str
    dtype: torch.dtype
    atol: float

    @property
    def exact(self) -> bool:
        """float32 on CPU: greedy tokens must match free-running, no teacher forcing."""
        return self.dtype == torch.float32 and self.device == "cpu"

    def __str__(self) -> str:
        name = self.attn if isinstance(self.attn, str) else self.attn.name
        return f"{name}-{str(self.dtype).removeprefix('torch.')}-{self.device}"


TORCH = BackendSpec("torch", "cpu", torch.float32, 1e-5)
# bf16 on CPU exercises the teacher-forced path here; a few bf16 ULPs at |logit| < 1.
TORCH_BF16 = BackendSpec("torch", "cpu", torch.bfloat16, 2e-2)
# FlashInfer's kernels tile cold prefills and warm suffixes differently: allow a few ULPs
# of fp16 / bf16 at the tiny model's logit scale (|logit| < 1). Wrong KV moves logits
# more: skipping one 2-token partial copy moved them by 0.057 (measured on CPU). These
# bounds are estimates until GPU runs calibrate them.
FI_FP16 = BackendSpec("flashinfer", "cuda", torch.float16, 1e-2)
FI_BF16 = BackendSpec("flashinfer", "cuda", torch.bfloat16, 3e-2)

GPU_MARKS = (pytest.mark.gpu, pytest.mark.flashinfer)
CPU_BACKENDS = [pytest.param(TORCH, id="torch"), pytest.param(TORCH_BF16, id="torch-bf16")]
GPU_BACKENDS = [pytest.param(FI_FP16, id="fi-fp16", marks=GPU_MARKS),
                pytest.param(FI_BF16, id="fi-bf16", marks=GPU_MARKS)]
ALL_BACKENDS = CPU_BACKENDS + GPU_BACKENDS


class ReuseMode(NamedTuple):
    """The partial-reuse settings: partial reuse on or off, copy-on-partial on or off."""

    partial: bool
    copy: bool

    def __str__(self) -> str:
        return ("copy" if self.copy else "claim") if self.partial else "nopartial"


COPY = ReuseMode(True, True)  # partial reuse by claiming idle leaves or copying
CLAIM = ReuseMode(True, False)  # partial reuse only by claiming idle leaves
NO_PARTIAL = ReuseMode(False, False)
MODES = [pytest.param(COPY, id="copy"), pytest.param(CLAIM, id="claim"),
         pytest.param(NO_PARTIAL, id="nopartial")]


def tokens(rng: random.Random, n: int) -> list[int]:
    """`n` token ids uniform in [1, VOCAB)."""
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def prompts_of(seed: int, lengths: Sequence[int]) -> list[list[int]]:
    """Independent random prompts of the given lengths."""
    rng = random.Random(seed)
    return [tokens(rng, n) for n in lengths]


def unlike(token: int) -> int:
    """A token id different from `token` (to make a prompt diverge exactly there)."""
    return token % (VOCAB - 1) + 1


def forced(reference: Sequence[GenerationOutput] | None, backend: BackendSpec
           ) -> list[list[int]] | None:
    """Teacher-forcing tokens for a run compared with `reference` (None where exact)."""
    if reference is None or backend.exact:
        return None
    return [list(o.token_ids) for o in reference]


def assert_same_outputs(expected: Sequence[GenerationOutput], actual: Sequence[GenerationOutput],
                        backend: BackendSpec, where: str) -> None:
    """Same generated tokens, logits within the backend's tolerance (pairwise). Raises
    OutputMismatch at the first difference, carrying the repro record when the outputs
    came from recorded engines (the make_engine fixture's)."""
    __tracebackhide__ = True
    difference = first_difference(expected, actual, backend.atol)
    if difference is not None:
        message = describe(difference, where)
        raise OutputMismatch(message, outputs_record(where, backend.atol, expected, actual,
                                                     difference, message))


def _set_phase(engine: Engine, phase: str) -> None:
    """Tag `engine`'s next calls with `phase` in its recording (if it records)."""
    if isinstance(engine, RecordedEngine):
        engine.phase = phase


def _with_scenario_repro(engine: Engine, results: Sequence[GenerationOutput],
                         check: Callable[[], dict[str, int | float]],
                         failure: Callable[[int, list[OutputRef], list[dict[str, Any]]], Failure]
                         ) -> dict[str, int | float]:
    """Run a reuse `check` on `engine`; a ReuseMismatch it raises then carries a scenario
    record (which re-runs the engine; `failure` makes its Failure from the engine's index,
    the results' references and the checked rows) in place of the bare reuse record,
    when the engines are recorded."""
    __tracebackhide__ = True
    try:
        return check()
    except ReuseMismatch as exc:
        rows = [] if exc.failure is None else row_dicts(exc.failure.rows)
        record = check_record(engine, results, str(exc),
                              lambda index, refs: failure(index, refs, rows))
        if record is not None:
            exc.repro = record  # type: ignore[attr-defined]
        raise


class ColdWarm(NamedTuple):
    """Outputs of a cold run and of the warm run that followed it."""

    cold: list[GenerationOutput]
    warm: list[GenerationOutput]


class ScenarioRun:
    """One scenario test: its oracle checks, cold/warm runs and reuse-report records."""

    def __init__(self, name: str, node_id: str, params: dict[str, str],
                 report: ReuseReport) -> None:
        self.name = name
        self.node_id = node_id
        self.params = params
        self.report = report

    def expect_oracle(self, engine: Engine, results: Sequence[GenerationOutput] = (), *,
                      exact: bool = True, seed: int | None = None,
                      probe_replica: bool = True, bounded: bool = False
                      ) -> dict[str, int | float]:
        """Reuse since the engine started equals the oracle's replay of its admission
        log, in total and for each of `results` (exact=False: reuse at most, misses at
        least, the bound a bounded pool allows with partial reuse off; `bounded`: the
        oracle models the pool and host tier sizes, so evictions, offloads, onboards and
        drops are predicted too). Then probe_reuse must have matched every admission (on
        a replica) and the tree must be intact. Records the run in the reuse report,
        passed or not. Returns the stats window.
        """
        __tracebackhide__ = True
        adapter = KvcacheEngineAdapter(engine)
        prediction = predict_from_engine(adapter, bounded=bounded)
        config = {**adapter.cache_config, "backend": engine.attn_backend,
                  "max_num_tokens": engine.config.max_num_tokens}
        passed = False
        try:
            window = _with_scenario_repro(
                engine, results, lambda: expect_matches_oracle(
                    adapter, prediction, exact, results=list(results),
                    context=ReproContext(self.node_id, seed, config),
                    tree_dump=engine.manager.state.tree.dump),
                lambda index, refs, rows: OracleFailure(index, exact, bounded, refs, rows))
            if probe_replica:
                assert_probe_matches_admissions(engine)
            engine.manager.check_integrity()
            passed = True
        finally:
            expected = {k: int(v) for k, v in prediction.totals.as_dict().items()
                        if k != "cacheHitRate"} if exact else None
            self.report.add(ReuseRecord(self.name, self.node_id, self.params,
                                        diff_stats(None, engine.kv_cache_stats()), expected,
                                        passed))
        return window

    def expect_full_blocks_bounded(self, engine: Engine, results: Sequence[GenerationOutput],
                                   *, seed: int | None = None) -> dict[str, int | float]:
        """Full blocks reused, per request and in total, at most what the oracle predicts
        for the same log with an unbounded pool (eviction only removes full blocks; with
        partial reuse on, partial counts may differ either way). Recorded like
        `expect_oracle`; a failure carries a scenario record, so that `kvharness repro`
        re-runs the engine and checks the bound again. Returns the stats window."""
        __tracebackhide__ = True
        adapter = KvcacheEngineAdapter(engine)
        passed = False
        try:
            window = _with_scenario_repro(
                engine, results, lambda: expect_full_blocks_bounded(
                    adapter, list(results),
                    context=ReproContext(self.node_id, seed, dict(adapter.cache_config),
                                         adapter.admission_log()),
                    tree_dump=engine.manager.state.tree.dump),
                FullBlocksFailure)
            engine.manager.check_integrity()
            passed = True
        finally:
            self.report.add(ReuseRecord(self.name, self.node_id, self.params,
                                        diff_stats(None, engine.kv_cache_stats()), None,
                                        passed))
        return window

    def cold_warm(self, engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  backend: BackendSpec, *, scopes: Sequence[ReuseScope | None] | None = None,
                  one_by_one: bool = False, seed: int | None = None,
                  reference: Sequence[GenerationOutput] | None = None) -> ColdWarm:
        """Run `prompts` cold, then warm; assert warm equals cold and oracle-exact reuse.

        `one_by_one` runs the warm prompts one request at a time, checking on the
        engine's own manager that probe_reuse equals each admission's reuse. With a
        `reference` (outputs without reuse), the cold run must equal it too.
        """
        __tracebackhide__ = True
        _set_phase(engine, "cold")
        cold = engine.generate(prompts, max_new_tokens, scopes,
                               force_tokens=forced(reference, backend))
        _set_phase(engine, "warm")
        if reference is not None:
            assert_same_outputs(reference, cold, backend, "cold vs reference")
        force = forced(cold, backend)
        if one_by_one:
            warm = []
            for i, prompt in enumerate(prompts):
                scope = scopes[i] if scopes is not None else None
                probed = engine.manager.probe_reuse(prompt, scope)
                out = engine.generate([prompt], max_new_tokens, [scope],
                                      force_tokens=[force[i]] if force else None)[0]
                assert out.num_cached_tokens == probed, (
                    f"prompt {i}: probe_reuse said {probed} tokens, the admission reused "
                    f"{out.num_cached_tokens}")
                warm.append(out)
        else:
            warm = engine.generate(prompts, max_new_tokens, scopes, force_tokens=force)
        assert_same_outputs(cold, warm, backend, "warm vs cold")
        self.expect_oracle(engine, cold + warm, seed=seed)
        return ColdWarm(cold, warm)


MODEL_SEED = 0  # every scenario model's weights (a repro file records it)
POOL_TOKENS = 2048  # default pool: far more than any scenario holds, so nothing is evicted


# A model: a preset name, or a module-level function building the model from a seed (a
# variant no preset describes; the repro file names it as `module:function`, which
# harness/repro/registry.py must list for `kvharness repro` to build it).
ModelSpec = str | Callable[[int], Transformer]


class Models:
    """Models built once per (spec, device, dtype), weights from MODEL_SEED; engines share
    them (a model holds no per-request state). Mutates only its own cache."""

    def __init__(self) -> None:
        self._built: dict[tuple[ModelSpec, str, torch.dtype], Transformer] = {}

    def get(self, preset: ModelSpec, device: str, dtype: torch.dtype) -> Transformer:
        """The shared model for this preset (or builder), device and dtype."""
        key = (preset, device, dtype)
        if key not in self._built:
            model = (Transformer(get_preset(preset), seed=MODEL_SEED) if isinstance(preset, str)
                     else preset(MODEL_SEED))
            self._built[key] = model.to(device=device, dtype=dtype).eval()
        return self._built[key]


class EngineFactory:
    """Builds recorded engines for test `node_id` (a failed check writes a repro file that
    re-runs them); the harness checks `cache_owners()` for leaks after it."""

    def __init__(self, models: Models, node_id: str = "") -> None:
        self.models = models
        self.node_id = node_id
        self.created: list[RecordedEngine] = []

    def __call__(self, tokens_per_block: int, *, backend: BackendSpec = TORCH,
                 mode: ReuseMode | None = None, reuse: bool | None = None,
                 max_num_blocks: int | None = None, host_cache_blocks: int = 0,
                 preset: ModelSpec = "tiny", engine_class: type[Engine] = Engine,
                 **engine_options: Any) -> RecordedEngine:
        """A fresh engine. `mode` sets the partial-reuse flags (None: the defaults);
        `reuse` is enable_block_reuse; `max_num_blocks` defaults to POOL_TOKENS worth;
        `host_cache_blocks` adds a host tier; `engine_class` is kvcache's Engine or a
        subclass (tests/scenarios/faults.py); `engine_options` go to it (max_num_tokens,
        page_size, ...). Raises what the engine's constructor raises (then nothing is
        kept)."""
        blocks = max_num_blocks or -(-POOL_TOKENS // tokens_per_block)
        cfg = KvCacheConfig(
            tokens_per_block=tokens_per_block, max_num_blocks=blocks, enable_block_reuse=reuse,
            enable_partial_reuse=None if mode is None else mode.partial,
            copy_on_partial_reuse=mode.copy if mode is not None and mode.partial else None,
            host_cache_blocks=host_cache_blocks)
        model = self.models.get(preset, backend.device, backend.dtype)
        engine = recorded(engine_class)(
            model, cfg, preset=object_ref(preset), model_seed=MODEL_SEED, node_id=self.node_id,
            serial=len(self.created), attn_backend=backend.attn, device=backend.device,
            dtype=backend.dtype, **engine_options)
        self.created.append(engine)
        return engine

    def cold_reference(self, tokens_per_block: int, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int, *, backend: BackendSpec = TORCH,
                       preset: ModelSpec = "tiny") -> list[GenerationOutput]:
        """Outputs of `prompts` computed with nothing reused: a fresh engine admits them
        all in its first step, before anything is committed (asserted, so the reference
        stays cold whatever the reuse flags do)."""
        total = sum(len(p) for p in prompts) + len(prompts) * max_new_tokens
        engine = self(tokens_per_block, backend=backend, reuse=False, preset=preset,
                      max_num_tokens=max(total, 1), max_batch_size=len(prompts),
                      max_num_blocks=max(total, 1), enable_chunked_prefill=False)
        engine.phase = "reference"
        outs = engine.generate(prompts, max_new_tokens)
        assert [o.num_cached_tokens for o in outs] == [0] * len(prompts), "reference reused"
        return outs

    def cache_owners(self) -> list[KvCacheManager]:
        """Every engine's manager (the plugin's leak check reads this)."""
        return [e.manager for e in self.created]

"""Hostile repro files: `kvharness repro FILE` treats a repro file as data.

A file names models, backends and engine classes only from the harness's registry
(harness/repro/registry.py); any other name is refused, exit 2 with the field named,
before anything is imported (a module whose import would leave a marker file proves it).
Sizes a file asks for are bounded; a malformed admission-log event is a format error
naming the event and the field; and a re-run that fails on its own (an engine error,
out of memory) is exit 2, "cannot be re-run here", never 1 ("reproduced") with a
traceback. Each case starts from a real record (written by the recorder or a real
cache's log) that re-runs cleanly, changed one way. The ids are documented in
docs/bad_inputs.md ("Repro files").
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main as kvharness
from harness.repro.registry import TEST_OBJECTS, object_ref
from harness.repro.reuse_record import ReuseCheckRecord, plain
from harness.repro.scenario_record import OracleFailure
from harness.reuse.assertions import replay_config
from kvcache import Engine, KvCacheConfig, KvCacheManager
from kvcache.attention.base import AttentionBackend
from tests.hang_guard import run_child
from tests.scenarios.recording import check_record
from tests.scenarios.support import EngineFactory, Models, prompts_of

ROOT = Path(__file__).resolve().parents[2]
REPRO_IDS: set[str] = set()  # every case id below; docs/bad_inputs.md documents each
Edit = Callable[[dict[str, Any]], object]


def cases(*params: Any) -> list[Any]:
    REPRO_IDS.update(p.id for p in params)
    return list(params)


@pytest.fixture(scope="session")
def scenario_json() -> dict[str, Any]:
    """A real `kind: scenario` record: one tiny engine, the same prompt twice, its oracle
    check recorded as failed (the re-run finds it holds: exit 0)."""
    make_engine = EngineFactory(Models(), "t::hostile")
    engine = make_engine(4, max_num_blocks=16)
    (prompt,) = prompts_of(6, [9])
    outs = engine.generate([prompt], 2) + engine.generate([prompt], 2)
    record = check_record(engine, outs, "recorded",
                          lambda i, refs: OracleFailure(i, True, False, refs, []))
    assert record is not None
    return record.to_json()


@pytest.fixture(scope="session")
def reuse_json() -> dict[str, Any]:
    """A real `kind: reuse` record: a 6-block pool's log of two admissions of one
    prompt, its check a bound that holds (exit 0)."""
    manager = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=6),
                             record_events=True)
    prompt = list(range(1, 17))
    for seq_id in ("a", "b"):
        manager.add_sequence(seq_id, prompt)
        manager.commit(seq_id, len(prompt))
        manager.free_sequence(seq_id)
    rows = [{"where": "total", "counter": "reusedBlocks", "at_least": 1, "at_most": None,
             "actual": None}]
    record = ReuseCheckRecord("t::reuse", "expect_reuse", None, replay_config(manager.state.config),
                              plain([e.as_dict() for e in manager.state.events]), None, False, rows,
                              "m")
    return record.to_json()


def write(tmp_path: Path, data: dict[str, Any], edit: Edit | None = None) -> Path:
    data = copy.deepcopy(data)
    if edit is not None:
        edit(data)
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(data))
    return path


def recipe(**changes: Any) -> Edit:
    return lambda d: d["engines"][0]["recipe"].update(changes)


def options(**changes: Any) -> Edit:
    return lambda d: d["engines"][0]["recipe"]["options"].update(changes)


def cache(**changes: Any) -> Edit:
    return lambda d: d["engines"][0]["recipe"]["cache"].update(changes)


def call(index: int, **changes: Any) -> Edit:
    return lambda d: d["engines"][0]["calls"][index].update(changes)


def event(index: int, **changes: Any) -> Edit:
    return lambda d: d["admission_log"][index].update(changes)


def drop_seq_id(d: dict[str, Any]) -> None:
    del d["admission_log"][0]["seq_id"]


def abort_unknown(d: dict[str, Any]) -> None:
    d["engines"][0]["calls"].append({
        "op": "abort", "phase": "hostile", "rids": [99], "prompts": [], "max_new_tokens": None,
        "scopes": None, "force_tokens": None, "priority": None, "return_logits": True})


def many_engines(d: dict[str, Any]) -> None:
    d["engines"] *= 17


def nan_tolerance(d: dict[str, Any]) -> None:  # NaN: every comparison fails, "reproduced"
    d["failure"] = {"check": "outputs", "where": "warm vs cold", "atol": float("nan"),
                    "expected": [[0, 0]], "actual": [[0, 1]], "difference": {}}


def many_prompts(d: dict[str, Any]) -> None:  # 300 calls of 4000 tokens: 1.2 M tokens
    first = d["engines"][0]["calls"][0]
    d["engines"][0]["calls"] = [{**first, "prompts": [[1] * 4000]} for _ in range(300)]


def test_the_unchanged_records_rerun(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     scenario_json: dict[str, Any],
                                     reuse_json: dict[str, Any]) -> None:
    # The cases below change these one way each: the refusal is that change's.
    assert kvharness(["repro", str(write(tmp_path, scenario_json))]) == 0
    assert kvharness(["repro", str(write(tmp_path, reuse_json))]) == 0
    assert "did not reproduce" in capsys.readouterr().out


@pytest.mark.parametrize(("kind", "edit", "message"), cases(
    pytest.param("scenario", recipe(preset="time:sleep", model_seed=3600),
                 r"engines\[0\]\.recipe\.preset: 'time:sleep' is not a model preset or "
                 r"builder kvharness repro can build; it builds tiny, .*"
                 r"tests\.scenarios\.test_hybrid:opaque_hybrid", id="repro-preset-sleep"),
    pytest.param("scenario", recipe(backend="tests.scenarios.faults:OverCountingEngine"),
                 r"engines\[0\]\.recipe\.backend: 'tests\.scenarios\.faults:OverCountingEngine'"
                 r" is not an attention backend", id="repro-backend-other-kind"),
    pytest.param("scenario", recipe(device="meta"),
                 r"engines\[0\]\.recipe\.device: 'meta' is not a device kvharness repro runs "
                 r"on; expected cpu, cuda or cuda:N", id="repro-device-meta"),
    pytest.param("scenario", recipe(dtype="_dynamo"),
                 r"engines\[0\]\.recipe\.dtype: '_dynamo' is not a dtype kvharness repro "
                 r"runs; expected one of float32, float16, bfloat16, float64",
                 id="repro-dtype-not-a-dtype"),
    pytest.param("scenario", cache(max_num_blocks=10**8),
                 r"field 'engines\[0\]\.recipe\.cache\.max_num_blocks' is 100000000; a re-run "
                 r"allows 0 to 65536", id="repro-pool-1e8-blocks"),
    pytest.param("scenario", cache(max_num_blocks=65536, tokens_per_block=64),
                 r"field 'engines\[0\]\.recipe\.cache\.max_num_blocks' is 65536 blocks of 64 "
                 r"tokens; a re-run allows pools of at most 262144 tokens",
                 id="repro-pool-tokens"),
    pytest.param("scenario", recipe(model_seed=10**30),
                 r"field 'engines\[0\]\.recipe\.model_seed' is 10{30}; a re-run allows 0 to "
                 r"9223372036854775807", id="repro-seed-huge"),
    pytest.param("scenario", call(1, max_new_tokens=10**9),
                 r"field 'engines\[0\]\.calls\[1\]\.max_new_tokens' is 1000000000; a re-run "
                 r"allows 0 to 65536", id="repro-new-tokens-huge"),
    pytest.param("scenario", many_prompts,
                 r"field 'engines\[0\]\.calls\[262\]\.prompts' takes the record past 1048576 "
                 r"tokens in all", id="repro-tokens-in-all"),
    pytest.param("scenario", many_engines,
                 r"field 'engines' holds 17 engines; a re-run builds 1 to 16",
                 id="repro-engines-too-many"),
    pytest.param("scenario", nan_tolerance,
                 r"field 'failure\.atol' is nan; a tolerance is a finite number >= 0",
                 id="repro-atol-nan"),
    pytest.param("scenario", call(0, scopes=[{"salt": {"hex": "zz"}, "lora_id": None}]),
                 r"field 'engines\[0\]\.calls\[0\]\.scopes' item 0 must be null or "
                 r"\{salt, lora_id\}", id="repro-scope-bad-hex"),
    pytest.param("scenario", abort_unknown,
                 r"engines\[0\]\.calls\[2\] \(abort, hostile\): the engine refused it: "
                 r"abort\(99\): no such request", id="repro-call-refused"),
    pytest.param("scenario", options(max_num_tokenz=8),
                 r"engines\[0\]\.recipe: the engine cannot be built: options: unknown "
                 r"EngineConfig keys \['max_num_tokenz'\]; known keys are \['attn_backend'",
                 id="repro-option-unknown"),
    pytest.param("scenario", options(attn_backend="tests.scenarios.faults:StalePrefixBackend"),
                 r"engines\[0\]\.recipe: the engine cannot be built: options: "
                 r"\['attn_backend'\] belong in the recipe's own fields", id="repro-option-apart"),
    pytest.param("scenario", recipe(backend="flashinfer"),
                 r"cannot be re-run here: RuntimeError: FlashInferBackend "
                 r"needs .*\(raised at .*\)", id="repro-rerun-runtime-error"),
    pytest.param("reuse", lambda d: d["config"].update(max_num_blocks=10**8),
                 r"field 'config\.max_num_blocks' is 100000000; a re-run allows 0 to 65536",
                 id="repro-reuse-pool-1e8-blocks"),
    pytest.param("reuse", drop_seq_id, r"field 'admission_log\[0\]\.seq_id' is missing",
                 id="repro-event-no-seq-id"),
    pytest.param("reuse", event(0, scope=5),
                 r"field 'admission_log\[0\]\.scope' must be list or null, got 5",
                 id="repro-event-scope-5"),
    pytest.param("reuse", event(0, scope=[1, -2]),
                 r"field 'admission_log\[0\]\.scope' must be null or \[salt, lora_id\]",
                 id="repro-event-scope-lora"),
    pytest.param("reuse", lambda d: d["config"].update(max_num_blocks=2),
                 r"field 'admission_log\[0\]\.tokens' \(admit of seq_id 'a'\) does not fit "
                 r"the recorded pool \(config\.max_num_blocks=2\)", id="repro-event-unfit-pool"),
    pytest.param("reuse", event(1, seq_id="nobody"),
                 r"field 'admission_log\[1\]' \(commit of seq_id 'nobody'\) cannot be "
                 r"replayed: .*nobody", id="repro-event-out-of-order"),
    pytest.param("reuse", event(0, kind="evict"),
                 r"field 'admission_log\[0\]\.kind' is 'evict'; expected one of admit, commit",
                 id="repro-event-kind"),
    pytest.param("reuse", event(0, tokens=[1, -1]),
                 r"field 'admission_log\[0\]\.tokens' item 1 is -1; token ids are ints in "
                 r"\[0, 2\*\*32\)", id="repro-event-token"),
    pytest.param("reuse", lambda d: d["admission_log"].insert(2, 7),
                 r"admission_log\[2\] must be a JSON object, got int", id="repro-event-not-object"),
))
def test_a_hostile_file_is_exit_2_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], scenario_json: dict[str, Any],
        reuse_json: dict[str, Any], kind: str, edit: Edit, message: str) -> None:
    path = write(tmp_path, scenario_json if kind == "scenario" else reuse_json, edit)
    capsys.readouterr()
    assert kvharness(["repro", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"^kvharness repro: {re.escape(str(path))}: .*{message}", err), err
    assert "Traceback" not in err


@pytest.mark.parametrize(("make", "message"), cases(
    pytest.param(lambda p: p.write_text("[" * 100_000), ":1: not a readable repro file: "
                 "arrays and objects nested more than 32 levels deep", id="repro-json-deep"),
    pytest.param(lambda p: p.write_text('{"format": 1' + "0" * 5000 + "}"),
                 "not a readable repro file: Exceeds the limit", id="repro-json-long-int"),
    pytest.param(lambda p: os.truncate(p, (64 << 20) + 1) if p.touch() is None else None,
                 "not a readable repro file: larger than 67108864 bytes", id="repro-file-huge"),
    pytest.param(lambda p: p.mkdir(), "not a readable repro file: not a regular file",
                 id="repro-not-a-file"),
))
def test_an_unreadable_file_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      make: Callable[[Path], object], message: str) -> None:
    path = tmp_path / "hostile.json"
    make(path)
    assert kvharness(["repro", str(path)]) == 2
    err = capsys.readouterr().err
    # the file named first (JSON nested too deeply: with the line of the bracket)
    assert re.match(rf"kvharness repro: {re.escape(str(path))}(:[0-9]+)?: ", err), err
    assert message in err, err


@pytest.mark.parametrize("field", cases(
    pytest.param("preset", id="repro-preset-module"),
    pytest.param("backend", id="repro-backend-module"),
    pytest.param("engine", id="repro-engine-module"),
))
def test_a_named_module_is_never_imported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        scenario_json: dict[str, Any], field: str) -> None:
    marker = tmp_path / "imported"
    module = f"kvh_hostile_{field}"
    (tmp_path / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').close()\nx = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, scenario_json, recipe(**{field: f"{module}:x"}))
    assert kvharness(["repro", str(path)]) == 2
    assert f"engines[0].recipe.{field}: '{module}:x' is not" in capsys.readouterr().err
    assert not marker.exists() and module not in sys.modules


def test_an_engine_class_this_s_runs_no_module_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        scenario_json: dict[str, Any]) -> None:
    # `import this` prints the Zen of Python: the old replay printed it, then refused
    # the class as no Engine subclass.
    assert "this" not in sys.modules
    path = write(tmp_path, scenario_json, recipe(engine="this:s"))
    assert kvharness(["repro", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "engines[0].recipe.engine: 'this:s' is not an engine class" in err
    assert "this" not in sys.modules and "Beautiful is better" not in out + err


REPRO_IDS.add("repro-engine-this")


def _fresh(path: Path, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """`kvharness repro PATH` in a fresh interpreter (its exit status is the point),
    after `prelude` (Python run first)."""
    code = textwrap.dedent(prelude) + (
        "import sys\nfrom harness.cli import main\nsys.exit(main(['repro', sys.argv[1]]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return run_child([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env)


def test_a_preset_os_exit_is_exit_2_not_0(tmp_path: Path,
                                          scenario_json: dict[str, Any]) -> None:
    # os._exit(0) ended the old replay with status 0: "the failure is gone" to git bisect.
    done = _fresh(write(tmp_path, scenario_json, recipe(preset="os:_exit")))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "engines[0].recipe.preset: 'os:_exit' is not a model preset" in done.stderr


REPRO_IDS.add("repro-preset-os-exit")

# Run after the imports a re-run needs: leave the process 256 MiB more address space,
# far less than the 1 GiB pool of the record, so the engine's storage cannot be had.
_LIMIT_MEMORY = """\
    import resource
    import torch
    torch.set_num_threads(1)
    import harness.cli, kvcache.engine.engine, kvcache.attention.registry
    with open("/proc/self/status") as status:
        size = next(int(ln.split()[1]) for ln in status if ln.startswith("VmSize")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
    """


@pytest.mark.skipif(not Path("/proc/self/status").exists() or sys.platform != "linux",
                    reason="limits the address space through Linux's /proc and RLIMIT_AS")
def test_a_rerun_out_of_memory_is_exit_2(tmp_path: Path,
                                         scenario_json: dict[str, Any]) -> None:
    # The largest pool the format allows (65536 blocks of 4 tokens: 1 GiB of tiny KV)
    # in a process that cannot have it: a real allocation failure, no traceback, exit 2.
    done = _fresh(write(tmp_path, scenario_json, cache(max_num_blocks=65536)),
                  _LIMIT_MEMORY)
    assert done.returncode == 2, done.stdout + done.stderr
    # the engine names the cache field to lower (bad_inputs: eng-storage-memory)
    assert re.search(r"the engine cannot be built: Engine: cannot allocate the KV storage "
                     r"on cpu: KvCacheConfig\.max_num_blocks=65536", done.stderr), done.stderr
    assert "Traceback" not in done.stderr


REPRO_IDS.add("repro-rerun-out-of-memory")


@pytest.mark.parametrize("entry", TEST_OBJECTS, ids=lambda e: e.name)
def test_every_registered_test_object_is_what_the_recorder_names(entry: Any) -> None:
    obj = entry.load("registry")
    assert object_ref(obj) == entry.name  # the name the recorder writes for it
    if entry.kind == "engine":
        assert isinstance(obj, type) and issubclass(obj, Engine)
    elif entry.kind == "backend":
        assert isinstance(obj, type) and issubclass(obj, AttentionBackend)
    else:
        assert callable(obj) and not isinstance(obj, type)

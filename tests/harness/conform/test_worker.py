"""The worker's JSON protocol: data only, every failure a reply, a dead or failing worker
an error that quotes its log; the harness side refuses what it cannot run, checks every
reply, closes the worker on every failure, and voids a run whose engine touched a stub.

The pipe's tests run a fake engine install (fake_worker.py as its interpreter: kvcache
posing as SGLang 0.5.23, through the real worker) or the real worker behind a wrapper; no
engine venv is needed."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest

from harness.conform import ops
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.controller import install, speed
from harness.conform.controller.locks import find_lock, pinned
from harness.conform.controller.remote import WorkerError, WorkerTarget
from harness.conform.controller.report import Report
from harness.conform.controller.runner import conform
from harness.conform.stubs import StubSpec, StubUsedError, raising_function
from harness.conform.worker.serve import serve
from harness.conform.worker.session import Session

FAKE_WORKER = Path(__file__).with_name("fake_worker.py")
ENGINE, VERSION = "sglang", "0.5.23"  # a lock with raising stubs


def _talk(*requests: object) -> list[dict[str, object]]:
    out = io.StringIO()
    serve(io.StringIO("".join(json.dumps(r) + "\n" for r in requests) + "not json\n"), out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_every_bad_request_gets_an_error_reply_and_the_worker_goes_on() -> None:
    replies = _talk({"cmd": "open", "num_blocks": 8, "block_size": 4},
                    {"cmd": "load", "engine": "harness.conform.adapters.kvcache"},
                    {"cmd": "load", "engine": "vllm", "stubs": {"mock": {}}}, [1, 2])
    assert [r["ok"] for r in replies] == [False] * 5
    assert replies[0]["error"] == "ValueError: 'open' before load"
    # a module path is not an engine name: nothing is imported
    assert replies[1]["error"].startswith("ValueError: no adapter for engine "
                                          "'harness.conform.adapters.kvcache'")
    assert "unknown keys ['mock']" in replies[2]["error"]
    assert "a request is a JSON object" in replies[3]["error"]
    assert replies[4]["error"].startswith("JSONDecodeError")


def test_a_worker_whose_engine_is_missing_fails_loading_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match=r"load: ModuleNotFoundError: No module named 'vllm'"):
        WorkerTarget(Path(sys.executable), "vllm", StubSpec(), tmp_path / "worker.log")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vllm is installed in this interpreter")
def test_a_bare_name_needs_the_engine_installed_here(tmp_path: Path) -> None:
    report = conform("vllm", tmp_path, seeds=0, say=lambda _: None)
    assert report.exit_code == 2
    assert report.reason.startswith("vllm is not installed in this environment")


# -- the pipe, end to end ------------------------------------------------------------------

Configure = Callable[..., Path]


@pytest.fixture
def fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Configure:
    """A cached install of sglang 0.5.23 whose interpreter is fake_worker.py (in an
    engine cache of its own); link folders go to tmp_path/tmp. Returns configure(**how):
    sets $KVH_FAKE_WORKER and returns the run's report folder."""
    lock = find_lock(ENGINE, VERSION)
    cache = tmp_path / "engines"
    python = cache / lock.key / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_WORKER}" "$@"\n')
    python.chmod(0o755)
    (cache / lock.key / "stamp.json").write_text(json.dumps({"stamp": install.stamp(lock)}))
    monkeypatch.setenv(install.CACHE_ENV, str(cache))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    def configure(**how: Any) -> Path:
        monkeypatch.setenv("KVH_FAKE_WORKER", json.dumps(
            {"version": VERSION, "pid_file": str(tmp_path / "pid"), **how}))
        return tmp_path / "report"

    return configure


def _run(folder: Path) -> Report:
    return conform(f"{ENGINE}=={VERSION}", folder, seeds=0, only=["cold_then_warm"],
                   say=lambda _: None)


def _assert_closed(tmp_path: Path) -> None:
    """The worker's process is gone (reaped) and its link folder removed."""
    assert list((tmp_path / "tmp").glob("kvharness-worker-*")) == []
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_fake_engine_passes_as_kvcache_does(fake_engine: Configure,
                                                tmp_path: Path) -> None:
    said: list[str] = []
    report = conform(f" {ENGINE}=={VERSION} ", fake_engine(), seeds=0,
                     only=["cold_then_warm"], say=said.append)
    assert report.exit_code == 0, report.reason
    assert report.worker["engine"] == ENGINE and report.install["reused"] is True
    # the SPEC that runs is said first, before the install is looked for (or downloaded)
    assert said[0] == (f"conform {ENGINE}=={VERSION} (the SPEC ' {ENGINE}=={VERSION} ' "
                       "without its surrounding spaces)")
    assert said[1].startswith(f"importing {ENGINE} {VERSION} in ")
    _assert_closed(tmp_path)


# Replies the harness cannot use, each a bad input of docs/bad_inputs.md (checked there by
# tests/reliability/test_bad_inputs.py::test_catalogue_is_documented).
LONG = "x" * 1000
BAD_REPLIES = [
    pytest.param("load", "[]", "the worker's reply to 'load' is not a JSON object (got "
                 "list): '[]'", id="conform-reply-list"),
    pytest.param("load", "null", "the worker's reply to 'load' is not a JSON object (got "
                 "NoneType): 'null'", id="conform-reply-null"),
    pytest.param("load", "sitecustomize says hello", "the worker's reply to 'load' is not "
                 "JSON (Expecting value: line 1 column 1 (char 0)): 'sitecustomize says "
                 "hello'", id="conform-reply-not-json"),
    pytest.param("load", '{"ok": true, "engine": "sglang"}', "the worker's reply to 'load' "
                 "lacks 'version' (a string): '{\"ok\": true, \"engine\": \"sglang\"}'",
                 id="conform-reply-missing-field"),
    pytest.param("load", '{"ok": "yes"}', "the worker's reply to 'load' says neither "
                 "\"ok\": true nor \"ok\": false: '{\"ok\": \"yes\"}'", id="conform-reply-ok"),
    pytest.param("load", '{"ok": false}', "the worker's reply to 'load' is a failure "
                 "without an error message: '{\"ok\": false}'", id="conform-reply-no-error"),
    pytest.param("selftest", '{"ok": true, "problems": "none", "sources": {}, '
                 '"substitutes": 0}', "the worker's reply to 'selftest' has 'problems' = "
                 "\"none\", not an array", id="conform-reply-wrong-type"),
    pytest.param("open", '{"ok": true}', "the worker's reply to 'open' lacks 'contract' (an "
                 "object): '{\"ok\": true}'", id="conform-reply-open"),
    pytest.param("ops", '{"ok": true, "reports": [1]}', "the worker's reply to 'ops': "
                 "report 0: malformed (TypeError: 'int' object is not subscriptable)",
                 id="conform-reply-bad-report"),
    pytest.param("ops", '{"ok": true, "reports": []}', "the worker's reply to 'ops' has 0 "
                 "reports for 1 ops", id="conform-reply-no-report"),
    pytest.param("ops", LONG, f"the worker's reply to 'ops' is not JSON (Expecting value: "
                 f"line 1 column 1 (char 0)): '{'x' * 200}...'", id="conform-reply-long"),
    pytest.param("ops", "[" * 5000, "the worker's reply to 'ops' is not JSON (maximum "
                 "recursion depth exceeded", id="conform-reply-deep"),
]
WORKER_IDS = {p.id for p in BAD_REPLIES}


@pytest.mark.parametrize(("request_name", "reply", "reason"), BAD_REPLIES)
def test_a_reply_the_harness_cannot_use_is_exit_2_naming_it(
        fake_engine: Configure, tmp_path: Path, request_name: str, reply: str,
        reason: str) -> None:
    folder = fake_engine(replies={request_name: reply})
    report = _run(folder)
    assert report.exit_code == 2
    assert report.reason.startswith(reason), report.reason
    assert LONG not in report.reason  # 200 characters of the reply, no more
    written = json.loads((folder / "report.json").read_text())
    assert written["exit_code"] == 2 and written["reason"] == report.reason
    _assert_closed(tmp_path)


def test_a_touched_stub_voids_the_run(fake_engine: Configure, tmp_path: Path) -> None:
    report = _run(fake_engine(stub=True))
    stub = "torchvision"  # the first raising stub of the lock
    lock = find_lock(ENGINE, VERSION).path
    assert report.exit_code == 2, [c.message for c in report.failed]  # not a violation
    assert report.reason.startswith(f"ops: StubUsedError: {stub}.mark_computed: {stub} is "
                                    "a stub (the PyPI wheel is a CUDA build"), report.reason
    assert f"The engine touched the stub {stub}.mark_computed: the run cannot be trusted. " \
           f"Its cache path reaches {stub}, which {lock} lists among the modules that " \
           "cannot run here" in report.reason
    assert report.checks == []  # the check did not finish: it has no verdict
    _assert_closed(tmp_path)


class _CommitsThroughAStub(KvcacheCache):
    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        raising_function("sglang.srt.mem_cache.memory_pool.ReqToTokenPool", "a device pool")()


def test_a_stub_the_engine_reaches_is_never_the_engines_own_failure() -> None:
    session = Session(_CommitsThroughAStub(16, 4))
    assert session.apply(ops.admit("A", list(range(1, 10)))).status == "done"
    # an engine's exception is its finding ("raised", an api violation); a stub's is not
    with pytest.raises(StubUsedError, match=r"ReqToTokenPool\(\) was called, but it is a "
                                            r"stub \(a device pool\)") as info:
        session.apply(ops.commit("A", 9))
    assert info.value.stub == "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
    assert info.value.module == "sglang.srt.mem_cache.memory_pool"


def _wrapper(tmp_path: Path, before: str) -> Path:
    """This interpreter behind a shell script that runs `before` first (as a venv's .pth
    or sitecustomize runs before the worker's code)."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\n{before}\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


def test_output_before_the_worker_starts_is_never_a_reply(tmp_path: Path) -> None:
    python = _wrapper(tmp_path, "echo 'a .pth file says hello'")
    with pytest.raises(WorkerError, match=r"load: ModuleNotFoundError: No module named "
                                          r"'vllm'"):
        WorkerTarget(python, "vllm", StubSpec(), tmp_path / "worker.log")
    assert "a .pth file says hello" in (tmp_path / "worker.log").read_text()


def test_a_worker_that_fails_to_load_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    python = _wrapper(tmp_path, f'echo $$ > "{tmp_path / "pid"}"')  # exec keeps the pid
    with pytest.raises(WorkerError, match=r"load: ModuleNotFoundError"):
        WorkerTarget(python, "vllm", StubSpec(), tmp_path / "worker.log")
    _assert_closed(tmp_path)


# -- nox -s bench's table: the pinned engines whose install exists, beside kvcache ---------


def test_the_speed_table_runs_each_installed_pinned_engine(
        fake_engine: Configure, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake_engine()
    monkeypatch.chdir(tmp_path)
    pinned_specs = [lock.spec for lock in pinned()]
    assert f"{ENGINE}=={VERSION}" in pinned_specs  # the fake install is of a pinned release
    assert speed.main([str(tmp_path / "bench"), "--quick"]) == 0
    text = (tmp_path / "bench" / "conform.md").read_text()
    assert f"### {ENGINE}=={VERSION}" in text and f"| kvcache / {ENGINE} |" in text
    # the others are not installed: skipped, and said so
    assert text.count("### ") == 1
    said = capsys.readouterr().out.splitlines()
    assert len([line for line in said if line.startswith("conform bench: ")]) == \
        len(pinned_specs) - 1
    # its report is where every conform run of that release files it
    report = json.loads((tmp_path / "results" / "conform" / f"{ENGINE}-{VERSION}" /
                         "report.json").read_text())
    assert report["exit_code"] == 0
    assert {row["adapter"].split()[0] for row in report["bench"]} == {"kvcache", ENGINE}


def test_the_speed_table_without_an_install_says_which_command_installs_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(install.CACHE_ENV, str(tmp_path / "engines"))
    said: list[str] = []
    lines = speed.section(False, said.append)
    first = pinned()[0].spec
    assert lines[-1] == f"skipped: no engine is installed (`kvharness conform {first}` " \
                        "installs one)"
    assert said[0] == f"conform bench: {first} is not installed; skipped (kvharness " \
                      f"conform {first} installs it)"


# -- an engine that raises -----------------------------------------------------------------

# each calls every op kind but evict twice or more (the fuzz's seeds 0 and 1 evict twice)
RAISING_CHECKS = ["multi_turn", "chunked_admission"]


def test_an_engine_that_raises_is_a_finding_never_a_crash(fake_engine: Configure) -> None:
    """Through the worker's pipe, a free that raises (test_judge.py plants each kind and
    way of raising in this process; the _wide twin, post-merge, each kind through the
    pipe)."""
    _raises_through_the_pipe(fake_engine, "free")


@pytest.mark.parametrize("kind", ops.KINDS)
def test_an_engine_that_raises_is_a_finding_never_a_crash_wide(fake_engine: Configure,
                                                               kind: str) -> None:
    _raises_through_the_pipe(fake_engine, kind)


def _raises_through_the_pipe(fake_engine: Configure, kind: str) -> None:
    # the second call of `kind` raises after the engine acted, before its log was
    # written: its used blocks then disagree with every model, and the session still
    # drives what the engine freed or holds what it admitted; every check, the fuzz
    # and each shrink run to their verdict through the pipe (test_judge.py has each
    # way of raising, in this process)
    report = conform(f"{ENGINE}=={VERSION}",
                     fake_engine(raises={"kind": kind, "when": "unlogged"}),
                     seeds=2, only=RAISING_CHECKS, say=lambda _: None)
    assert (report.exit_code, report.reason) == (1, "")
    assert len(report.checks) == len(RAISING_CHECKS) + 2 and report.failed
    for check in report.failed:
        assert (check.oracle, check.status) == ("api", "fail"), check.message
        assert f"RuntimeError: planted: {kind} raised after it was done" in check.message
        assert check.ops[-1]["kind"] == kind  # shrunk to the op that raised

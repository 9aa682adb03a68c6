"""The worker's JSON protocol: data only, every failure a reply, a dead or failing worker
an error that quotes its log; the harness side refuses what it cannot run."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

from harness.conform.remote import WorkerError, WorkerTarget
from harness.conform.runner import conform
from harness.conform.stubs import StubSpec
from harness.conform.worker import serve


def _talk(*requests: object) -> list[dict[str, object]]:
    out = io.StringIO()
    serve(io.StringIO("".join(json.dumps(r) + "\n" for r in requests) + "not json\n"), out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_every_bad_request_gets_an_error_reply_and_the_worker_goes_on() -> None:
    replies = _talk({"cmd": "open", "num_blocks": 8, "block_size": 4},
                    {"cmd": "load", "engine": "harness.conform.kvcache_adapter"},
                    {"cmd": "load", "engine": "vllm", "stubs": {"mock": {}}}, [1, 2])
    assert [r["ok"] for r in replies] == [False] * 5
    assert replies[0]["error"] == "ValueError: 'open' before load"
    # a module path is not an engine name: nothing is imported
    assert replies[1]["error"].startswith("ValueError: no adapter for engine "
                                          "'harness.conform.kvcache_adapter'")
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

"""Two runs of one release write the same report.json but for timings and the day and
machine they ran on (`run`): every timing is a key named `seconds`
(harness.conform.controller.report.Report), and the worker fixes PYTHONHASHSEED (vLLM
seeds its block hashes from it, randomly per process without it). The same on the pinned
engines: test_engine_full.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from harness.conform.controller.remote import HASH_SEED, worker_environment
from harness.conform.controller.runner import conform


def without_timings(data: Any) -> Any:
    """`data` with every key named `seconds` dropped, however deep."""
    if isinstance(data, dict):
        return {k: without_timings(v) for k, v in data.items() if k != "seconds"}
    if isinstance(data, list):
        return [without_timings(v) for v in data]
    return data


def two_runs(spec: str, tmp_path: Path, **kwargs: Any) -> tuple[str, str]:
    """Two runs' report.json texts, each without its timings and its `run` (the day, which
    two runs either side of midnight differ in, and the machine)."""
    texts = []
    for run in ("a", "b"):
        conform(spec, tmp_path / run, say=lambda _: None, **kwargs)
        data = json.loads((tmp_path / run / "report.json").read_text())
        assert set(data.pop("run")) == {"date", "machine"}
        texts.append(json.dumps(without_timings(data), indent=1))
    return texts[0], texts[1]


def test_two_kvcache_runs_write_the_same_report_but_timings(tmp_path: Path) -> None:
    first, second = two_runs("kvcache", tmp_path, seeds=3)
    assert '"seconds"' not in first and '"checks"' in first
    assert first == second


@pytest.mark.parametrize("here", [None, "random", "123"])
def test_the_worker_runs_with_a_fixed_hash_seed(here: str | None, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's interpreter gets PYTHONHASHSEED whatever the harness's has: vLLM's
    NONE_HASH seed (and every str hash) is then the same in every run."""
    if here is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", here)
    env = worker_environment(Path("/venv/bin/python"), tmp_path / "links", tmp_path / "src")
    assert env["PYTHONHASHSEED"] == HASH_SEED
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "links"), str(tmp_path / "src")]


def test_each_release_builds_its_cpp_extensions_in_its_own_venv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang 0.5.19 on JIT-builds its event hash under one name for every release: a
    worker's builds stay in its venv, so two releases' workers never rebuild one
    extension under each other (whatever folder is set here)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "shared"))
    envs = [worker_environment(Path(f"/{v}/venv/bin/python"), tmp_path, None)
            for v in ("0.5.21", "0.5.23")]
    assert [e["TORCH_EXTENSIONS_DIR"] for e in envs] == \
        ["/0.5.21/venv/torch_extensions", "/0.5.23/venv/torch_extensions"]

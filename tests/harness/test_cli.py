"""The kvharness CLI: detect, list (--explain, --json; exit 1 when no block applies),
validate, report, --version, and bad flags."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.cli import main

LIST = """\
version: 0.0.1
l0_cpu:
- condition:
    ranges:
      system_gpu_count: {gte: 0, lte: 0}
    wildcards:
      gpu: ['*cpu*']
    terms:
      stage: pre_merge
  tests:
  - tests/test_a.py TIMEOUT (2)
  - {test: tests/test_b.py::test_b, isolation: true}
- condition:
    wildcards:
      gpu: ['*h100*']
    terms:
      stage: pre_merge
      attention_backend: flashinfer
  tests:
  - tests/gpu
"""

JUNIT = """<?xml version="1.0"?>
<testsuites><testsuite name="pytest" tests="2">
<testcase classname="tests.test_a" name="test_x" file="tests/test_a.py"/>
<testcase classname="tests.test_a" name="test_y" file="tests/test_a.py"><skipped/></testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def test_db(tmp_path: Path) -> Path:
    db = tmp_path / "test-db"
    db.mkdir()
    (db / "l0_cpu.yml").write_text(LIST)
    return db


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_detect(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "detect", "--json")
    data = json.loads(out)
    assert code == 0 and data["cuda"] is torch.cuda.is_available()
    assert set(data) == {"gpu", "gpu_count", "cuda", "flashinfer", "cpu_arch", "backends",
                         "distribution", "compute_capability", "supports_int8",
                         "supports_tf32", "supports_bf16", "supports_fp8", "supports_fp4"}
    if not data["cuda"]:
        assert data["compute_capability"] is None and data["supports_fp8"] is False
    code, out, _ = run(capsys, "detect")
    assert code == 0 and f"gpu: {data['gpu']}\n" in out and "backends: torch" in out


def test_list_prints_selected_entries(capsys: pytest.CaptureFixture[str], test_db: Path) -> None:
    code, out, _ = run(capsys, "list", "--test-db", str(test_db), "--gpu", "cpu", "--gpu-count", "0")
    assert code == 0
    assert out.splitlines() == [
        f"tests/test_a.py  (timeout 120 s)  [{test_db}/l0_cpu.yml:11]",
        f"tests/test_b.py::test_b  (isolated)  [{test_db}/l0_cpu.yml:12]",
    ]


def test_list_explain_says_why(capsys: pytest.CaptureFixture[str], test_db: Path) -> None:
    code, out, err = run(capsys, "list", "--test-db", str(test_db), "--gpu", "NVIDIA H100",
                         "--gpu-count", "1", "--backend", "torch", "--explain")
    assert code == 1  # nothing applies: see test_list_with_no_block_that_applies_fails
    assert err.startswith(f"kvharness list: no block of {test_db} applies to stage=pre_merge ")
    assert out.splitlines() == [
        "machine: stage=pre_merge gpu='NVIDIA H100' (pretended) gpu_count=1 cc=9.0 backends=torch "
        f"cuda={'yes' if torch.cuda.is_available() else 'no'}",
        f"l0_cpu[0] ({test_db}/l0_cpu.yml:3): not selected",
        "  [ok] stage pre_merge",
        "  [no] gpu count 1 outside [0, 0]",
        "  [no] gpu 'NVIDIA H100' matches none of ['*cpu*']",
        f"l0_cpu[1] ({test_db}/l0_cpu.yml:13): not selected",
        "  [ok] stage pre_merge",
        "  [no] attention backend flashinfer is not among this run's backends (torch)",
        "  [ok] gpu 'NVIDIA H100' matches '*h100*'",
        "0 entries selected",
    ]


def test_list_json(capsys: pytest.CaptureFixture[str], test_db: Path) -> None:
    code, out, _ = run(capsys, "list", "--test-db", str(test_db), "--gpu", "cpu",
                       "--gpu-count", "0", "--json")
    data = json.loads(out)
    assert code == 0 and data["machine"]["gpu"] == "cpu"
    assert [(e["test"], e["timeout_seconds"], e["isolation"]) for e in data["selected"]] == [
        ("tests/test_a.py", 120, False), ("tests/test_b.py::test_b", 3600, True)]
    assert [b["selected"] for b in data["blocks"]] == [True, False]
    assert data["blocks"][1]["checks"][2] == {
        "key": "gpu", "passed": False, "detail": "gpu 'cpu' matches none of ['*h100*']"}


def test_validate_reports_problems_and_exit_code(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, test_db: Path
) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("def test_x(): pass\n")
    code, out, _ = run(capsys, "validate", "--test-db", str(test_db), "--rootdir", str(tmp_path))
    assert code == 1
    assert out.splitlines() == [
        f"{test_db}/l0_cpu.yml:12: entry 'tests/test_b.py::test_b': no such file or folder "
        f"'tests/test_b.py' under {tmp_path}; closest: tests/test_a.py::test_x",
        f"{test_db}/l0_cpu.yml:20: entry 'tests/gpu': no such file or folder 'tests/gpu' under "
        f"{tmp_path}",
        "2 problems: 2 blocks, 3 entries, 0 waives, 1 collected tests",
    ]


def test_validate_broken_schema_is_exit_1(capsys: pytest.CaptureFixture[str], test_db: Path) -> None:
    (test_db / "l0_cpu.yml").write_text(LIST.replace("pre_merge", "premerge", 1))
    code, out, err = run(capsys, "validate", "--test-db", str(test_db))
    assert code == 1 and out == ""
    assert err.startswith(f"kvharness validate: {test_db}/l0_cpu.yml:9: l0_cpu[0].condition."
                          "terms.stage: 'premerge' is not one of pre_merge, post_merge")


def test_report_prints_and_writes_the_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    results = tmp_path / "results" / "premerge"
    results.mkdir(parents=True)
    (results / "junit.xml").write_text(JUNIT)
    summary = tmp_path / "summary.md"
    code, out, _ = run(capsys, "report", "--results-dir", str(tmp_path / "results"),
                       "--output", str(summary))
    assert code == 0 and out == summary.read_text()
    assert "| `tests/test_a.py` | 1 | 0 | 1 | 0 |" in out


def test_report_on_a_missing_folder_is_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "report", "--results-dir", str(tmp_path / "nope"))
    assert code == 1 and "is not a directory" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param([], "the following arguments are required: COMMAND", id="no-command"),
        pytest.param(["lst"], "invalid choice: 'lst'", id="unknown-command"),
        pytest.param(["list", "--stage", "nightly"], "argument --stage: invalid choice: 'nightly'",
                     id="stage"),
        pytest.param(["list", "--gpu-count", "two"], "gpu count 'two' is not an integer", id="count"),
        pytest.param(["list", "--gpu", ""], "gpu name is empty", id="empty-gpu"),
        pytest.param(["detect", "--jsn"], "unrecognized arguments: --jsn", id="unknown-flag"),
    ],
)
def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    exe = shutil.which("kvharness")
    assert exe is not None, "kvharness is not on PATH: pip install -e ."
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True)
    assert "detect" in done.stdout and "validate" in done.stdout


def test_list_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    db = tmp_path / "test-db"
    db.mkdir()
    entries = "".join(f"  - tests/test_{i:05d}.py::test_with_a_long_enough_name\n"
                      for i in range(4000))  # far more than a pipe's buffer
    (db / "l0_cpu.yml").write_text("version: 0.0.1\nl0_cpu:\n- condition: {terms: "
                                   "{stage: pre_merge}}\n  tests:\n" + entries)
    done = subprocess.run(f"{sys.executable} -m harness.cli list --test-db {db} | head -n 2",
                          shell=True, capture_output=True, text=True, check=True)
    assert len(done.stdout.splitlines()) == 2
    assert done.stderr == ""


def test_list_reads_one_context(capsys: pytest.CaptureFixture[str], test_db: Path) -> None:
    code, out, _ = run(capsys, "list", "--test-db", str(test_db), "--context", "l0_cpu",
                       "--gpu", "cpu")
    assert code == 0 and out.splitlines()[0].startswith("tests/test_a.py  (timeout 120 s)")
    code, _, err = run(capsys, "list", "--test-db", str(test_db), "--context", "l0_x")
    assert code == 1
    assert err == f"kvharness list: {test_db}: no context 'l0_x'; this test-db holds l0_cpu\n"


def test_list_with_no_block_that_applies_fails(capsys: pytest.CaptureFixture[str],
                                               test_db: Path) -> None:
    """An empty selection is not an answer a runner should act on: exit 1, and say for
    each block which machine terms it wanted."""
    code, out, err = run(capsys, "list", "--test-db", str(test_db), "--gpu", "NVIDIA B200",
                         "--gpu-count", "2", "--stage", "post_merge")
    assert code == 1 and out == ""
    assert err.splitlines() == [
        f"kvharness list: no block of {test_db} applies to stage=post_merge gpu='NVIDIA B200' "
        f"(pretended) gpu_count=2 cc=10.0 backends=torch,flashinfer "
        f"cuda={'yes' if torch.cuda.is_available() else 'no'}",
        f"  l0_cpu[0] ({test_db}/l0_cpu.yml:3): stage post_merge, block wants pre_merge; "
        "gpu count 2 outside [0, 0]; gpu 'NVIDIA B200' matches none of ['*cpu*']",
        f"  l0_cpu[1] ({test_db}/l0_cpu.yml:13): stage post_merge, block wants pre_merge; "
        "gpu 'NVIDIA B200' matches none of ['*h100*']",
    ]
    code, out, err = run(capsys, "list", "--test-db", str(test_db), "--context", "l0_cpu",
                         "--gpu", "NVIDIA B200", "--json")
    assert code == 1 and json.loads(out)["selected"] == []
    assert err.startswith(f"kvharness list: no block of context l0_cpu of {test_db} applies")


def test_version(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"kvharness {importlib.metadata.version('kvcache-harness')}\n"

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    # Run from a checkout that was never installed: say so rather than guess a number.
    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == (
        "kvharness (not installed: kvcache-harness has no distribution metadata here)\n")

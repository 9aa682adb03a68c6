"""`kvharness validate --syntax-only`, `kvharness test-db` and `kvharness sysinfo` on
TensorRT-LLM's real files (issue 24): the pre-commit check without collection, the
renders `trt-test-db` would write, compared with hand-checked expectations, and the
machine description as get_sysinfo.py's "Mako options"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

TRTLLM = Path(__file__).parent / "lists" / "trtllm"
FIXTURES = TRTLLM / "fixtures"
WAIVES = FIXTURES / "waives.txt"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_real_files_pass_the_syntax_check_without_collecting() -> None:
    """`validate --syntax-only` on the four real lists and the 455-line waives file: exit
    0, no pytest run, torch never imported (a fresh interpreter, as pre-commit runs it)."""
    probe = ("import sys, subprocess\n"
             "subprocess.run = None  # collection would run pytest in a subprocess\n"
             "from harness.cli import main\n"
             f"code = main(['validate', '--syntax-only', '-d', {str(FIXTURES)!r}, "
             f"'--waives', {str(WAIVES)!r}])\n"
             "assert 'torch' not in sys.modules and 'kvcache' not in sys.modules, 'heavy import'\n"
             "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == ("ok, 52 warnings: 20 blocks, 540 entries, 455 waives, "
                                            "syntax only, no tests collected")


def test_syntax_only_reports_every_problem_with_exit_1(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    db = tmp_path / "test-db"
    db.mkdir()
    text = (FIXTURES / "l0_a100.yml").read_text()
    (db / "l0_a100.yml").write_text(text.replace("stage: pre_merge", "stage: premerge", 1)
                                    .replace('-m "part0"', '-m "part0 and"', 1))
    (db / "l0_h100.yml").write_text((FIXTURES / "l0_h100.yml").read_text())
    waives = tmp_path / "waives.txt"
    waives.write_text("unittest/a.py SKIP (x\nunittest/b.py SKIP\n")
    code, out, _ = run(capsys, "validate", "--syntax-only", "-d", str(db), "--waives", str(waives))
    assert code == 1
    lines = out.splitlines()
    assert [line.split(": ", 1)[0].rsplit("/", 1)[-1] for line in lines[:3]] == [
        "l0_a100.yml:13", "l0_a100.yml:16", "waives.txt:1"]
    assert lines[-1].startswith("3 problems, 1 warnings: 0 blocks")
    # --context reads only its file: l0_h100 is fine.
    code, out, _ = run(capsys, "validate", "--syntax-only", "-d", str(db), "--context", "l0_h100",
                       "--waives", str(tmp_path / "none.txt"))
    assert code == 1 and "l0_a100" not in out and "none.txt: waives file does not exist" in out

"""report.json and report.md: every check, each finding with its op list, the exit code."""

from __future__ import annotations

import json
from pathlib import Path

from harness.conform.controller.report import CheckResult, Report, markdown, write_report


def _report() -> Report:
    bad = CheckResult("scope_isolation", "scope isolation", "salts and LoRAs", "fail",
                      "count", "admit(S7, ...) reused 16 tokens | of LoRA 1",
                      ({"kind": "admit", "seq": "S0", "tokens": [1, 2]},),
                      ("admit(S0, tokens [1, 2])",), 30, 64, 0.5, also=("provenance: ...",))
    good = CheckResult("cold_then_warm", "cold then warm", "cold, warm", "pass", seconds=0.1)
    return Report("sglang==0.5.12", "sglang", "0.5.12", 1, contract={"engine": "sglang"},
                  checks=[good, bad], seconds={"total": 3.0})


def test_both_files_say_the_same(tmp_path: Path) -> None:
    as_json, as_md = write_report(_report(), tmp_path / "out")
    data = json.loads(as_json.read_text())
    assert data["exit_code"] == 1
    assert [c["status"] for c in data["checks"]] == ["pass", "fail"]
    assert data["checks"][1]["ops"] == [{"kind": "admit", "seq": "S0", "tokens": [1, 2]}]
    text = as_md.read_text()
    assert "**violations found** (exit 1): 1 of 2 checks failed" in text
    assert "## Finding: scope_isolation (count)" in text
    assert "admit(S0, tokens [1, 2])" in text and "- also: provenance: ..." in text
    # a | in a message stays inside its table cell
    assert "reused 16 tokens \\| of LoRA 1" in text


def test_a_run_that_could_not_run_says_why() -> None:
    lines = markdown(Report("vllm==0.30.0", reason="vllm 0.30.0 is not supported"))
    assert lines[2] == "**could not run** (exit 2): vllm 0.30.0 is not supported"

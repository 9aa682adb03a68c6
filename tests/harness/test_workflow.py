"""CI plumbing: the GitHub workflow against GitHub's schema (offline, check-jsonschema's
vendored copy), its steps calling ci/ scripts, the scripts themselves, the nox sessions,
and the committed test lists and durations file."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.lists.db import load_test_db
from harness.lists.hardware import Machine

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
CONFORM = ROOT / ".github" / "workflows" / "conform.yml"
SCRIPTS = sorted((ROOT / "ci").glob("*.sh"))


def _check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("check-jsonschema")
    if exe is None:
        pytest.skip("check-jsonschema is not installed (pip install -e .[test])")
    return subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", str(path)],
                          capture_output=True, text=True, check=False)


def _jobs(workflow: Path = WORKFLOW) -> dict[str, Any]:
    jobs: dict[str, Any] = yaml.safe_load(workflow.read_text())["jobs"]
    return jobs


@pytest.mark.parametrize("workflow", [WORKFLOW, CONFORM], ids=["ci", "conform"])
def test_workflow_matches_githubs_schema(workflow: Path) -> None:
    done = _check_jsonschema(workflow)
    assert done.returncode == 0, done.stdout + done.stderr


def test_schema_check_rejects_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("    runs-on: ubuntu-latest\n",
                                                   "    runs_on: ubuntu-latest\n", 1))
    done = _check_jsonschema(broken)
    assert done.returncode == 1 and "$.jobs.cpu: 'runs-on' is a required property" in done.stdout


@pytest.mark.parametrize("workflow", [WORKFLOW, CONFORM], ids=["ci", "conform"])
def test_every_run_step_is_a_ci_script_or_nox(workflow: Path) -> None:
    for name, job in _jobs(workflow).items():
        for step in job["steps"]:
            command = step.get("run")
            if command is None:
                assert step["uses"].split("@")[0] in (
                    "actions/checkout", "actions/setup-python", "actions/upload-artifact",
                    "actions/download-artifact", "actions/cache"), name
                continue
            program = command.split()[0]
            assert program == "nox" or (ROOT / program) in SCRIPTS, f"{name}: {command}"


def test_the_conform_workflow_runs_every_locked_release_on_a_schedule() -> None:
    """Its job matrix is the releases job's output, which ci/conform_releases.sh reads
    from the locks; each job caches the engine venvs and pip's cache and uploads its
    report; the last job folds them, whatever the releases found."""
    from harness.conform.controller.locks import supported

    data = yaml.safe_load(CONFORM.read_text())
    assert "schedule" in data[True] and "workflow_dispatch" in data[True]  # YAML's `on`
    jobs = data["jobs"]
    assert jobs["conform"]["strategy"]["matrix"]["release"] == \
        "${{ fromJSON(needs.releases.outputs.releases) }}"
    cached = next(s for s in jobs["conform"]["steps"] if s.get("uses", "").startswith(
        "actions/cache"))["with"]["path"].split()
    assert cached == ["~/.cache/kvharness/engines", "~/.cache/pip"]
    assert jobs["matrix"]["needs"] == "conform" and jobs["matrix"]["if"] == "always()"
    line = subprocess.run(["ci/conform_releases.sh"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert line.startswith("releases=")
    listed = [r["spec"] for r in json.loads(line.removeprefix("releases="))]
    assert listed == [f"{e}=={v}" for e, vs in sorted(supported().items()) for v in vs]


def test_conform_matrix_script_writes_the_table_into_the_document(tmp_path: Path) -> None:
    from harness.conform.controller.matrix import BEGIN, END

    report = {"spec": "kvcache", "engine": "kvcache", "version": "0.1.0", "exit_code": 0,
              "verdict": "passed", "checks": [{"name": "cold_then_warm", "status": "pass",
                                               "family": "cold then warm"}]}
    (tmp_path / "reports" / "kvcache").mkdir(parents=True)
    (tmp_path / "reports" / "kvcache" / "report.json").write_text(json.dumps(report))
    doc = tmp_path / "doc.md"
    doc.write_text(f"{BEGIN}\n{END}\n")
    summary = tmp_path / "summary.md"
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
    subprocess.run(["ci/conform_matrix.sh", str(tmp_path / "reports"), str(doc)], cwd=ROOT,
                   env=env, check=True, capture_output=True)
    assert "| kvcache 0.1.0 | this checkout | passed | pass |" in doc.read_text()
    assert summary.read_text().startswith("# Conformance matrix\n\n| release |")
    assert (tmp_path / "reports" / "matrix.md").read_text() in summary.read_text()


def test_gpu_jobs_run_on_labelled_runners_with_a_list_per_kind() -> None:
    contexts = {b.context for b in load_test_db(ROOT / "test_lists" / "test-db").blocks}
    gpu_jobs = {n: j for n, j in _jobs().items() if "self-hosted" in j["runs-on"]}
    assert set(gpu_jobs) == {"gpu-premerge", "gpu-check", "gpu-postmerge", "bench"}
    for job in gpu_jobs.values():
        assert job["runs-on"] == ["self-hosted", "linux", "gpu", "${{ matrix.gpu }}"]
        assert {f"l0_{gpu}" for gpu in job["strategy"]["matrix"]["gpu"]} <= contexts
    shards = gpu_jobs["gpu-postmerge"]["strategy"]["matrix"]
    assert shards["shard"] == list(range(1, shards["shards"][0] + 1))


def test_lists_lint_and_summary_run_even_when_tests_failed() -> None:
    steps = _jobs()["cpu"]["steps"]
    after_tests = steps[[s.get("run") for s in steps].index("ci/cpu.sh premerge") + 1:]
    runs = [s["run"] for s in after_tests if "run" in s]
    assert runs == ["nox -s lists", "nox -s lint", "ci/job_summary.sh results/premerge"]
    assert all(s.get("if") == "always()" for s in after_tests)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_scripts_are_executable_bash(script: Path) -> None:
    assert os.access(script, os.X_OK), f"{script} is not executable"
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        pytest.param(["ci/cpu.sh", "nightly"], 2, "unknown session 'nightly'", id="cpu-session"),
        pytest.param(["ci/gpu_postmerge.sh", "1"], 2, "usage: ci/gpu_postmerge.sh SHARD SHARDS",
                     id="postmerge-usage"),
        pytest.param(["ci/conform.sh", "vllm"], 2, "usage: ci/conform.sh ENGINE==VERSION",
                     id="conform-usage"),
        pytest.param(["ci/conform_matrix.sh"], 2, "usage: ci/conform_matrix.sh REPORTS [DOC]",
                     id="conform-matrix-usage"),
    ],
)
def test_scripts_reject_bad_arguments(argv: list[str], code: int, message: str) -> None:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == code and message in done.stderr


def test_job_summary_appends_the_report(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "reuse_report.json").write_text('{"records": []}')
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
    subprocess.run(["ci/job_summary.sh", str(results)], cwd=ROOT, env=env, check=True)
    text = summary.read_text()
    assert text.startswith("earlier step\n# Results: results\n") and "## Reuse" in text


def test_nox_sessions() -> None:
    nox = shutil.which("nox")
    if nox is None:
        pytest.skip("nox is not installed (pip install -e .[dev])")
    listing = subprocess.run([nox, "--list"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    sessions = {line[2:].split(" -> ")[0]: line[0] for line in listing.splitlines()
                if line[:2] in ("* ", "- ")}
    assert sessions == {"premerge": "*", "postmerge": "-", "lists": "-", "lint": "-", "bench": "-",
                        "gpu": "-", "repro": "-", "structure": "-", "conform": "-",
                        "mutants": "-", "gate_bench": "-"}


def test_noxfile_needs_the_nox_the_dev_extra_installs() -> None:
    """nox reads `nox.needs_version` as a literal before it runs the noxfile; keep it equal
    to the dev extra's requirement so `pip install -e .[dev]` gives a nox that qualifies."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    needs = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
             and ast.unparse(node.targets[0]) == "nox.needs_version"
             and isinstance(node.value, ast.Constant)]
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    assert len(needs) == 1 and f"nox{needs[0]}" in dev, (needs, dev)


@pytest.mark.parametrize("stage", ["pre_merge", "post_merge"])
@pytest.mark.parametrize(
    ("gpu", "count", "backends", "context"),
    [
        pytest.param("cpu", 0, ["torch"], "l0_cpu", id="cpu"),
        pytest.param("NVIDIA H100 80GB HBM3", 8, ["torch", "flashinfer"], "l0_h100", id="h100"),
        pytest.param("NVIDIA H200", 1, ["torch", "flashinfer"], "l0_h200", id="h200"),
        pytest.param("NVIDIA B200", 4, ["torch", "flashinfer"], "l0_b200", id="b200"),
    ],
)
def test_committed_lists_select_one_context_per_machine(
    stage: str, gpu: str, count: int, backends: list[str], context: str
) -> None:
    db = load_test_db(ROOT / "test_lists" / "test-db")
    machine = Machine.from_dict({"stage": stage, "gpu": gpu, "gpu_count": count,
                                 "backends": backends, "cuda": count > 0, "cpu_arch": "x86_64"})
    selected = db.select(machine)
    assert selected and {e.source for e in selected} == {context}


def test_durations_file_is_pytest_split_json() -> None:
    durations = json.loads((ROOT / "test_lists" / ".test_durations").read_text())
    assert isinstance(durations, dict) and durations
    assert all("::" in k and isinstance(v, float) for k, v in durations.items())

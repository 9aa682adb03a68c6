"""Sessions: `nox -s premerge` before a merge, `nox -s postmerge` after it, `nox -s bench`,
`nox -s gpu` (the GPU check; `python -m harness.gpu_check` without nox).

premerge/postmerge run the test-db lists (test_lists/test-db) for the detected hardware;
anything after `--` goes to pytest and wins over the defaults (`-- --gpu h100
--gpu-count 1`, `-- -n 8 --gpu-per-worker`, `-- tests/unit`). Results (junit XML, the
reuse report, benchmark JSON) land in results/<session>/.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.needs_version = ">=2024.4"  # what pyproject's dev extra installs; nox reads it first
nox.options.sessions = ["premerge"]
nox.options.default_venv_backend = "venv"

# Sessions see the interpreter's site-packages so torch comes from the environment they
# run in (the CPU build here, the runner's CUDA build on GPU runners): never a bare
# `torch` requirement that lets the resolver pull a multi-GB build.
# Tools run as `python -m` so they use this interpreter (and its editable install of the
# project) even when the system site-packages already provide them.
VENV_PARAMS = ["--system-site-packages"]
TEST_DB = "test_lists/test-db"


def _setup(session: nox.Session, extras: str) -> Path:
    """Install the project with `extras`; return a fresh results/<session> folder."""
    # Fail first, and plainly, where the interpreter nox runs on has no torch to share.
    session.run("python", "-c", "import torch", silent=True)
    session.install("-e", f".[{extras}]")
    results = Path("results") / session.name
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    return results


def _run_lists(session: nox.Session, stage: str) -> None:
    """Run the test-db lists of `stage` for this machine; posargs go to pytest last."""
    results = _setup(session, "test,bench")
    session.run("python", "-m", "pytest", f"--test-db={TEST_DB}", f"--stage={stage}",
                f"--results-dir={results}", f"--junitxml={results / 'junit.xml'}",
                *session.posargs)


@nox.session(venv_params=VENV_PARAMS)
def premerge(session: nox.Session) -> None:
    """Run the pre-merge lists for this machine."""
    _run_lists(session, "pre_merge")


@nox.session(venv_params=VENV_PARAMS)
def postmerge(session: nox.Session) -> None:
    """Run the post-merge lists for this machine."""
    _run_lists(session, "post_merge")


@nox.session(venv_params=VENV_PARAMS)
def lists(session: nox.Session) -> None:
    """Validate the test lists and waives against the collected tests."""
    _setup(session, "test")
    session.run("python", "-m", "harness.cli", "validate", f"--test-db={TEST_DB}",
                *session.posargs)


@nox.session(venv_params=VENV_PARAMS)
def lint(session: nox.Session) -> None:
    """Ruff on the code, tests, benchmarks and tools; mypy on kvcache/, harness/ and tools/."""
    _setup(session, "dev")
    session.run("python", "-m", "ruff", "check", "kvcache", "harness", "tests", "benchmarks",
                "tools", "noxfile.py")
    session.run("python", "-m", "mypy")
    session.run("python", "-m", "mypy", "tools")


@nox.session(venv_params=VENV_PARAMS, default=False)
def structure(session: nox.Session) -> None:
    """The code's structure in numbers: files, long functions, foreign underscores, imports."""
    session.run("python", "tools/structure.py", *session.posargs)


@nox.session(venv_params=VENV_PARAMS, default=False)
def repro(session: nox.Session) -> None:
    """Replay a failed scenario or reuse check: nox -s repro -- results/<session>/repro/<test>.json."""
    session.install("-e", ".")
    session.run("python", "-m", "harness.cli", "repro", *session.posargs)


@nox.session(venv_params=VENV_PARAMS, default=False)
def bench(session: nox.Session) -> None:
    """Run the benchmarks; JSON, summary.md and plots in results/bench (-- --bench-quick: smoke)."""
    results = _setup(session, "test,bench")
    session.run("python", "-m", "pytest", "benchmarks",
                f"--benchmark-json={results / 'bench.json'}", "--benchmark-sort=fullname",
                f"--junitxml={results / 'junit.xml'}", *session.posargs)
    session.run("python", "-m", "benchmarks.report", str(results))


# What the GPU check imports besides torch and flashinfer; it runs the project from this
# checkout, so where the interpreter already has these nothing is installed (offline).
_GPU_CHECK_NEEDS = ("numpy", "yaml", "pydantic", "safetensors", "pytest", "pytest_timeout")


@nox.session(venv_params=VENV_PARAMS, default=False)
def gpu(session: nox.Session) -> None:
    """GPU check: FlashInfer, CUDA graphs, engine, benches; budgeted; results/gpu/report.md."""
    # torch and flashinfer come from the interpreter's site-packages and are never
    # installed here; `nox --no-venv -s gpu` runs in the current interpreter as it is.
    if session.venv_backend != "none":
        probe = ("import importlib.util as u; print(all(u.find_spec(m) for m in "
                 f"{_GPU_CHECK_NEEDS!r}))")
        if str(session.run("python", "-c", probe, silent=True)).strip() != "True":
            session.install("-e", ".[test]")  # offline: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR
    session.run("python", "-m", "harness.gpu_check", *session.posargs)

"""Sessions: `nox -s premerge` before a merge, `nox -s postmerge` after it, `nox -s bench`,
`nox -s gpu` (the GPU check; `python -m harness.gpu_check` without nox), `nox -s mutants`
(the harness's own mutation score, nightly).

premerge/postmerge run the test-db lists (test_lists/test-db) for the detected hardware;
anything after `--` goes to pytest and wins over the defaults (`-- --kvh-gpu h100
--kvh-gpu-count 1`, `-- -n 8 --kvh-gpu-per-worker`, `-- tests/unit`). premerge runs a
pytest-xdist worker per CPU (`-- -n 0` runs it serially, `-- -x` stops at the first
failure). Results (junit XML, the
reuse report, benchmark JSON) land in results/<session>/.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2024.4"  # what pyproject's dev extra installs; nox reads it first
nox.options.sessions = ["premerge"]
nox.options.default_venv_backend = "venv"

# torch comes from the environment nox runs in (a virtual environment's CPU build, a GPU
# runner's CUDA build), never from a bare `torch` requirement that lets the resolver pull
# a multi-GB build. No `--system-site-packages`: a venv made from inside another venv reads
# the *base* interpreter's site-packages, where the outer venv's torch is not, and it leaks
# whatever else the base holds (transformers' version, a stale install of this project).
# Instead each session gets a .pth naming the one folder of nox's sys.path that holds
# torch (and so its dependencies): the outer venv's site-packages, or the base's on a GPU
# runner whose image installed everything there, which is what sessions saw before.
# Tools run as `python -m` so they use the session's interpreter and its install.
TEST_DB = "test_lists/test-db"
# The pre-merge run is parallel by default: a pytest-xdist worker per CPU. `load` with
# chunks of one hands the next test of the fail-first order (the lists' `order:`) to
# whichever worker is free, so the cheapest bug-revealing tests run first on every
# worker and each worker's queue keeps that order (docs/design.md, "Scale-out").
# `-- -n 0` after the session runs it serially.
PARALLEL = ("-n", "auto", "--dist", "load", "--maxschedchunk", "1")
TORCH_PTH = "nox-torch.pth"
# `nox -s mutants`: the catalogue's mutants, then mutmut's generic ones of kvcache/core.
MUTANT_PASSES = {"catalogue": "tools/mutants.py", "generic": "tools/generic_mutants.py"}
CPU_TORCH = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
_PURELIB = "import sysconfig; print(sysconfig.get_path('purelib'))"


def torch_site() -> str | None:
    """The folder on this (nox's) interpreter's sys.path that holds torch, found without
    importing it; None when torch is not installed here."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(next(iter(spec.submodule_search_locations))).parent)


def no_torch_message(python: str) -> str:
    """What a session says when the interpreter nox runs on (`python`) has no torch."""
    return (f"torch is not installed where nox runs ({python}); sessions take torch from "
            f"there. Install the build for this machine into that environment, on a CPU "
            f"machine: `{python} -m pip install {CPU_TORCH}` (a GPU runner's image brings its "
            f"CUDA build), then run nox again.")


def share_torch(session: nox.Session) -> None:
    """Make the torch of the interpreter nox runs on importable in `session` (whose Python
    is that interpreter: no session names another) by writing TORCH_PTH into the session
    venv's site-packages; nothing under `--no-venv`, where the session runs in that
    interpreter, or on a venv reused under `--no-install`, which has it already. Stops the
    session with the install command when that interpreter has no torch."""
    site = torch_site()
    if site is None:
        session.error(no_torch_message(sys.executable))
    if session.venv_backend == "none":
        return
    purelib = session.run_install("python", "-c", _PURELIB, silent=True)
    if purelib is not None:  # the last line: stderr comes first, merged
        (Path(str(purelib).splitlines()[-1]) / TORCH_PTH).write_text(site + "\n")


def _install(session: nox.Session, target: str) -> None:
    """Share torch with `session`, then install `target` (this project, editable) into it;
    under `--no-venv` the current environment is used as it is."""
    share_torch(session)
    if session.venv_backend != "none":
        session.install("-e", target)


def _setup(session: nox.Session, extras: str) -> Path:
    """Install the project with `extras`; return a fresh results/<session> folder."""
    _install(session, f".[{extras}]")
    results = Path("results") / session.name
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    return results


def _run_lists(session: nox.Session, stage: str, *flags: str, extras: str = "test,bench"
               ) -> None:
    """Run the test-db lists of `stage` for this machine with pytest `flags`, the project
    installed with `extras`; posargs go to pytest last, so they win."""
    results = _setup(session, extras)
    session.run("python", "-m", "pytest", f"--kvh-test-db={TEST_DB}", f"--kvh-stage={stage}",
                f"--kvh-results-dir={results}", f"--junitxml={results / 'junit.xml'}",
                *flags, *session.posargs)


@nox.session
def premerge(session: nox.Session) -> None:
    """Run the pre-merge lists for this machine, in parallel (`-- -n 0`: serially)."""
    _run_lists(session, "pre_merge", *PARALLEL)


@nox.session
def postmerge(session: nox.Session) -> None:
    """Run the post-merge lists for this machine (with the mutation extra: the mutation
    tools' end-to-end tests)."""
    _run_lists(session, "post_merge", extras="test,bench,mutation")


@nox.session
def lists(session: nox.Session) -> None:
    """Validate the test lists and waives against the collected tests."""
    _setup(session, "test")
    session.run("python", "-m", "harness.cli", "validate", f"--test-db={TEST_DB}",
                *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff on the code, tests, benchmarks and tools; mypy on kvcache/, harness/ and tools/."""
    _setup(session, "dev")
    session.run("python", "-m", "ruff", "check", "kvcache", "harness", "tests", "benchmarks",
                "tools", "noxfile.py")
    session.run("python", "-m", "mypy")
    session.run("python", "-m", "mypy", "tools")


@nox.session(default=False)
def structure(session: nox.Session) -> None:
    """The code's structure in numbers: files, long functions, foreign underscores, imports."""
    session.run("python", "tools/structure.py", *session.posargs)


@nox.session(default=False)
def mutants(session: nox.Session) -> None:
    """The harness's mutation score (post-merge, nightly): each mutant of tools/mutants.yaml
    against the pre-merge lists, fail-fast (report.md, report.json, ttff.png), then mutmut's
    generic mutants of kvcache/core against the cache's tests (generic.md, generic.json),
    in results/mutants/. `-- catalogue [ARGS]` or `-- generic [ARGS]` runs one of them
    with its arguments (tools/mutants.py --help, tools/generic_mutants.py --help)."""
    args = list(session.posargs)
    if args and args[0] not in MUTANT_PASSES:
        session.error(f"nox -s mutants -- {args[0]}: name the pass first, one of "
                      f"{', '.join(MUTANT_PASSES)} (`-- catalogue --only ID`)")
    which = args[:1] or list(MUTANT_PASSES)
    results = _setup(session, "test,bench,mutation")
    for name in which:
        session.run("python", MUTANT_PASSES[name], f"--out={results}", *args[1:])


@nox.session(default=False)
def repro(session: nox.Session) -> None:
    """Replay a failed scenario or reuse check: nox -s repro -- results/<session>/repro/<test>.json."""
    _install(session, ".")
    session.run("python", "-m", "harness.cli", "repro", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Run the benchmarks; JSON, summary.md and plots in results/bench (-- --bench-quick: smoke)."""
    results = _setup(session, "test,bench")
    session.run("python", "-m", "pytest", "benchmarks",
                f"--benchmark-json={results / 'bench.json'}", "--benchmark-sort=fullname",
                f"--junitxml={results / 'junit.xml'}", *session.posargs)
    session.run("python", "-m", "benchmarks.report", str(results))
    # each pinned engine's cache beside kvcache's, where its install exists
    quick = "--bench-quick" in session.posargs or os.environ.get("KVH_BENCH_QUICK") == "1"
    session.run("python", "-m", "harness.conform.controller.speed", str(results),
                *(["--quick"] if quick else []))


@nox.session(default=False)
def conform(session: nox.Session) -> None:
    """kvharness conform from a fresh venv: nox -s conform -- ENGINE==VERSION [--bench]."""
    if not session.posargs:
        session.error("name an engine: nox -s conform -- ENGINE==VERSION (a lock of "
                      "harness/conform/locks/, or kvcache; more flags: kvharness conform --help)")
    _install(session, ".")  # the engine's venv links this session's torch
    # the report goes where kvharness conform puts it: results/conform/ENGINE-VERSION
    session.run("python", "-m", "harness.cli", "conform", *session.posargs)


@nox.session(default=False)
def gate_bench(session: nox.Session) -> None:
    """The gate's clean pass against 7215b7d's, back to back (tools/gate_bench.py --help):
    a benchmark for a quiet machine; gate_bench.json in results/gate_bench."""
    results = _setup(session, "test,bench")
    session.run("python", "tools/gate_bench.py", f"--out={results}", *session.posargs)


# What the GPU check imports besides torch and flashinfer; it runs the project from this
# checkout, so where torch's folder already has these nothing is installed (offline).
_GPU_CHECK_NEEDS = ("numpy", "yaml", "pydantic", "safetensors", "pytest", "pytest_timeout")


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """GPU check: FlashInfer, CUDA graphs, engine, benches; budgeted; results/gpu/report.md."""
    # torch and flashinfer come from the folder that holds torch where nox runs (a GPU
    # runner's image puts both there) and are never installed here; `nox --no-venv -s gpu`
    # runs in the current interpreter as it is.
    share_torch(session)
    if session.venv_backend != "none":
        probe = ("import importlib.util as u; print(all(u.find_spec(m) for m in "
                 f"{_GPU_CHECK_NEEDS!r}))")
        if str(session.run("python", "-c", probe, silent=True)).strip() != "True":
            session.install("-e", ".[test]")  # offline: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR
    session.run("python", "-m", "harness.gpu_check", *session.posargs)

"""Sessions: `nox -s premerge` before a merge, `nox -s postmerge` after it, `nox -s bench`."""

from __future__ import annotations

import nox

nox.options.sessions = ["premerge"]
nox.options.default_venv_backend = "venv"

# Sessions see the interpreter's site-packages so torch comes from the environment they
# run in (the CPU build here, the runner's CUDA build on GPU runners): never a bare
# `torch` requirement that lets the resolver pull a multi-GB build.
VENV_PARAMS = ["--system-site-packages"]


def _install(session: nox.Session, extras: str) -> None:
    session.run("python", "-c", "import torch", silent=True,
                success_codes=[0], external=False)
    session.install("-e", f".[{extras}]")


@nox.session(venv_params=VENV_PARAMS)
def premerge(session: nox.Session) -> None:
    """Run the pre-merge tests."""
    _install(session, "test")
    session.run("pytest", "tests", *session.posargs)


@nox.session(venv_params=VENV_PARAMS)
def lint(session: nox.Session) -> None:
    """Ruff and mypy on kvcache/ and harness/."""
    _install(session, "dev")
    session.run("ruff", "check", "kvcache", "harness", "tests", "benchmarks", "noxfile.py")
    session.run("mypy")

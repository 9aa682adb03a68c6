"""The quick start on real virtual environments: a session venv, made by nox from inside
another venv, imports torch from the folder that holds torch where nox runs (not from the
base interpreter), and nox run from a venv without torch stops with the install command
the README gives. The full fresh-venv run of the README's commands is `.ci/run`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hang_guard import run_child

ROOT = Path(__file__).resolve().parents[2]
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def _folder_of(module: str) -> Path:
    """The sys.path folder `module` is imported from here; skips where it is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{module} is not installed (pip install nox and torch, see README)")
    return Path(next(iter(spec.submodule_search_locations))).parent


def _nox(python: Path | str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_child([str(python), "-m", "nox", *args], cwd=cwd)


def test_a_session_venv_imports_torch_from_where_nox_runs(tmp_path: Path) -> None:
    """This interpreter (a venv's or a base's) runs nox; a venv made as premerge's sees no
    torch, not even the base interpreter's, until share_torch names torch's folder."""
    torch_folder = _folder_of("torch")
    _folder_of("nox")
    probe = ("import importlib.util as u; s = u.find_spec('torch'); "
             "print('TORCH', s.origin if s else None)")
    noxfile = tmp_path / "probe_noxfile.py"
    noxfile.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import nox
        from noxfile import premerge, share_torch

        # A venv made as premerge's is (pip left out: it changes no import path).
        @nox.session(venv_backend=premerge.venv_backend,
                     venv_params=[*(premerge.venv_params or []), "--without-pip"])
        def probe(session):
            session.run("python", "-c", {probe!r})
            share_torch(session)
            session.run("python", "-c", {probe!r})
            session.run("python", "-c", "import torch; print('IMPORTED', torch.__file__)")
        """))
    done = _nox(sys.executable, "-f", str(noxfile), "-s", "probe",
                "--envdir", str(tmp_path / "envs"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    found = [line.split(maxsplit=1)[1] for line in done.stdout.splitlines()
             if line.startswith(("TORCH ", "IMPORTED "))]
    init = str(torch_folder / "torch" / "__init__.py")
    assert found == ["None", init, init], done.stdout
    pth = next((tmp_path / "envs" / "probe").glob("lib*/python*/site-packages/nox-torch.pth"))
    assert pth.read_text() == f"{torch_folder}\n"


@pytest.mark.parametrize("mode", [[], ["--no-venv"]], ids=["venv", "no-venv"])
def test_nox_without_torch_names_the_install_command(tmp_path: Path, mode: list[str]) -> None:
    """nox from a fresh venv that has nox but no torch (this interpreter's nox folder minus
    torch): `nox -s premerge` stops before installing anything, naming the command."""
    nox_folder = _folder_of("nox")
    without_torch = tmp_path / "site"
    without_torch.mkdir()
    for entry in nox_folder.iterdir():
        if not entry.name.startswith(("torch", "functorch")):
            (without_torch / entry.name).symlink_to(entry)
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(outer)], check=True)
    site = next(outer.glob("lib*/python*/site-packages"))
    (site / "nox.pth").write_text(f"{without_torch}\n")
    python = outer / "bin" / "python"
    done = _nox(python, "-s", "premerge", "--envdir", str(tmp_path / "envs"), *mode, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert f"torch is not installed where nox runs ({python})" in output
    assert f"`{python} -m {CPU_TORCH}`" in output
    assert "pip install -e" not in output  # stopped before installing the project


def test_the_readme_quick_start_is_what_ci_runs() -> None:
    """The README's quick start installs torch as the no-torch message says, and .ci/run
    runs its two commands (bench as the smoke) from a venv it makes."""
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("\n## ", readme.index("## Quick start"))]
    for line in (CPU_TORCH, "nox -s bench", "nox -s premerge", 'pip install -e ".[test]"'):
        assert line in quick, line
    ci = (ROOT / ".ci" / "run").read_text()
    for line in ("-m venv", "nox -s premerge", "nox -s bench -- --bench-quick"):
        assert line in ci, line

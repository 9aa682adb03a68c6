"""An engine's source tree (`kvharness conform vllm@PATH`): where its package is, and
which release it is.

A tree is a checkout (vLLM's `vllm/` at the top, SGLang's under `python/`) or an unpacked
wheel. Its package is imported from where it is, never installed: the worker gets the
package root on its path. Its version, in order: an unpacked wheel's
`<package>-<version>.dist-info/METADATA`, the `_version.py` setuptools-scm writes into a
built checkout, a `version.py` that states `__version__` as a literal, or `git describe`
of a checkout turned into setuptools-scm's form (`v0.33.0-3-gabc1234` ->
`0.33.1.dev3+gabc1234`). Nothing in the tree is imported or run to learn it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from harness.conform.versions import parse_version

_ASSIGNED = re.compile(r"""^__version__\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
                       re.MULTILINE)
_DESCRIBED = re.compile(r"v?([0-9]+(?:\.[0-9]+)+)-([0-9]+)-g([0-9a-f]+)")


class TreeError(ValueError):
    """PATH is not a source tree of the engine, or its version cannot be told."""


def package_root(package: str, path: Path) -> Path:
    """The folder holding `package/__init__.py`: `path` or `path/python` (SGLang's
    layout). TreeError naming both otherwise."""
    for root in (path, path / "python"):
        if (root / package / "__init__.py").is_file():
            return root.resolve()
    raise TreeError(f"{path}: no {package}/__init__.py here or under {path / 'python'}; "
                    f"give the checkout or unpacked wheel of {package}")


def tree_version(package: str, root: Path) -> tuple[str, str]:
    """(the tree's version, where it was read) for `package` under `root` (see the module
    docstring). TreeError when no source says."""
    for meta in sorted(root.glob(f"{package}-*.dist-info/METADATA")):
        m = re.search(r"^Version: (\S+)$", meta.read_text(encoding="utf-8"), re.MULTILINE)
        if m:
            return _checked(m[1], meta), str(meta)
    for name in ("_version.py", "version.py"):
        file = root / package / name
        if file.is_file():
            m = _ASSIGNED.search(file.read_text(encoding="utf-8"))
            if m and m[1] != "dev":
                return _checked(m[1], file), str(file)
    described = _git_describe(root)
    if described is not None:
        return described
    raise TreeError(f"{root}: cannot tell which release of {package} this is (no "
                    f"{package}-*.dist-info, no version in {package}/_version.py or "
                    f"{package}/version.py, no tag `git describe` finds); build the checkout "
                    "once (`pip wheel --no-deps .` writes _version.py) or fetch its tags")


def _checked(text: str, where: Path | str) -> str:
    try:
        return parse_version(text).text
    except ValueError as exc:
        raise TreeError(f"{where}: {exc}") from None


def _git_describe(root: Path) -> tuple[str, str] | None:
    try:
        done = subprocess.run(["git", "-C", str(root), "describe", "--tags", "--long",
                               "--match", "v[0-9]*"], capture_output=True, text=True,
                              check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = _DESCRIBED.fullmatch(done.stdout.strip()) if done.returncode == 0 else None
    if m is None:
        return None
    return _scm_version(m[1], int(m[2]), m[3]), f"git describe in {root}"


def _scm_version(tag: str, distance: int, commit: str) -> str:
    """setuptools-scm's default: the tag itself, or the next patch release's dev number."""
    if distance == 0:
        return tag
    parts = [int(p) for p in tag.split(".")]
    parts[-1] += 1
    return f"{'.'.join(map(str, parts))}.dev{distance}+g{commit}"

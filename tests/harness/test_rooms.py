"""The harness's rooms keep the shape docs/architecture.md draws, measured by
tools/structure.py: no import loop between rooms (reuse/ and repro/ imported each other),
no module importing another's private names (the reuse replay read the assertions'
`_Row`, `_oracle_spec`, `_raise_if_failed`), lists/ reaching nothing above it but the
shared file readers, the oracles loading nothing from kvcache, and conform/'s worker side
(what runs in an engine's venv) importing nothing of the harness's side."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.tool_scripts import TOOLS, load_tool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def structure() -> ModuleType:
    return load_tool(TOOLS / "structure.py", "structure_tool")


def _targets(arrows: tuple[tuple[str, str], ...], room: str) -> set[str]:
    return {b for a, b in arrows if a == room}


def test_no_loops_between_rooms(structure: ModuleType) -> None:
    picture = structure.import_picture("harness", ROOT)
    assert picture.loops == ()
    assert "repro" not in _targets(picture.arrows, "reuse")
    assert "plugin" not in _targets(picture.arrows, "reports")
    assert _targets(picture.arrows, "lists") <= {"data_files"}
    assert _targets(picture.arrows, "oracle") == set()
    # conformance reads the oracles, never the plugin (pytest is not a runtime dependency)
    assert _targets(picture.arrows, "conform") == {"oracle", "reports", "data_files",
                                                   "workloads"}


def test_no_private_names_imported(structure: ModuleType) -> None:
    figures = structure.measure(("harness",), ROOT)
    assert [str(f) for figs in figures.values() for f in figs.private_imports] == []


def test_the_oracles_import_nothing_from_kvcache(structure: ModuleType) -> None:
    """harness/oracle's modules import nothing from kvcache, anywhere in them; the checked
    manager names it for type checking only (its module-level imports hold none)."""
    for path in sorted((ROOT / "harness" / "oracle").glob("*.py")):
        module = structure.module_name(path, ROOT)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if path.name == "checked_manager.py":
            tree.body = [n for n in tree.body if not isinstance(n, ast.If)]
        found = structure.imported_modules(tree, module, path.name == "__init__.py")
        assert not {m for m in found if m.split(".")[0] == "kvcache"}, path.name


# harness/conform: the modules both sides share, and the worker's side (what an engine's
# worker imports: the standard library only until an adapter loads its engine)
CONFORM_SHARED = {"protocol", "ops", "stubs", "known_keys", "versions"}
WORKER_SIDE = {"worker", "adapters", *CONFORM_SHARED}


def test_conform_keeps_the_worker_side_below_the_harness_side(structure: ModuleType) -> None:
    """The controller (the harness's side) may import anything of conform; the worker and
    the adapters import only the shared modules (and the worker the adapters' registry),
    the shared modules only each other, and no two files import each other at run time
    (bench.py and runner.py did: the worker sat above the harness)."""
    picture = structure.import_picture("harness.conform", ROOT)
    assert set(picture.rooms) == {"controller", *WORKER_SIDE}
    assert (picture.loops, picture.file_loops) == ((), ())
    assert _targets(picture.arrows, "worker") <= {"adapters", *CONFORM_SHARED}
    assert _targets(picture.arrows, "adapters") <= CONFORM_SHARED
    for room in CONFORM_SHARED:
        assert _targets(picture.arrows, room) <= CONFORM_SHARED, room


def _at_import_time(tree: ast.Module) -> ast.Module:
    """The imports of `tree` that run when it is imported: all but those in functions."""
    found: list[ast.stmt] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return ast.Module(body=found, type_ignores=[])


def _worker_side_files() -> list[Path]:
    base = ROOT / "harness" / "conform"
    return sorted([*(base / f"{m}.py" for m in CONFORM_SHARED),
                   *(base / "worker").rglob("*.py"), *(base / "adapters").rglob("*.py")])


def test_the_worker_side_imports_the_standard_library_and_itself(structure: ModuleType) -> None:
    """Every file the worker imports loads, when imported, the standard library, the worker
    side and `harness.workloads` (the benchmark's prompts) only; inside its functions an
    adapter loads its engine, but no file reaches the rest of the harness anywhere."""
    allowed = ("harness.workloads", *(f"harness.conform.{room}" for room in WORKER_SIDE))

    def ours(name: str) -> bool:
        return name in ("harness", "harness.conform") or name.startswith(allowed)

    for path in _worker_side_files():
        module = structure.module_name(path, ROOT)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        anywhere = structure.imported_modules(tree, module, is_package)
        assert {m for m in anywhere if m.split(".")[0] == "harness" and not ours(m)} == set(), \
            path.name
        top = structure.imported_modules(_at_import_time(tree), module, is_package)
        outside = {m.split(".")[0] for m in top if not ours(m)} - set(sys.stdlib_module_names)
        assert outside == set(), f"{path.relative_to(ROOT)} imports {outside}"

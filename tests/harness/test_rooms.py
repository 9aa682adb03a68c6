"""The harness's rooms keep the shape docs/architecture.md draws, measured by
tools/structure.py: no import loop between rooms (reuse/ and repro/ imported each other),
no module importing another's private names (the reuse replay read the assertions'
`_Row`, `_oracle_spec`, `_raise_if_failed`), lists/ reaching nothing above it but the
shared file readers, and the oracles loading nothing from kvcache."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def structure() -> ModuleType:
    spec = importlib.util.spec_from_file_location("structure_tool", ROOT / "tools" /
                                                  "structure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


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

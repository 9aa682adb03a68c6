"""tools/structure.py measures what it says, on a small tree written for it."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import ModuleType

import pytest


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


LONG = "def long():\n" + "".join(f"    x{i} = {i}\n" for i in range(61))

TREE = {
    "pkg/__init__.py": "",
    "pkg/a.py": """\
        from pkg.b import helper, _private
        from pkg.sub import c


        class A:
            def own(self):
                return self._x + super()._hook()

            def other(self, b):
                b._y = 1
                return b._z, b.__dict__, b._replace(y=2)._asdict()
        """,
    "pkg/b.py": """\
        import pkg.a


        def helper():
            return 1


        def _private():
            return 2
        """,
    "pkg/sub/__init__.py": "",
    "pkg/sub/c.py": "from . import d\n",
    "pkg/sub/d.py": LONG,
    "pkg/e.py": "from .a import A\n",
}


def test_figures_per_package(structure: ModuleType, tmp_path: Path) -> None:
    _write(tmp_path, TREE)
    figures = structure.measure(("pkg",), tmp_path)
    assert sorted(figures) == ["pkg", "pkg.sub"]
    top, sub = figures["pkg"], figures["pkg.sub"]
    assert (top.files, sub.files) == (4, 3)
    # b._y and b._z are another object's fields; self._x, a base's super()._hook,
    # b.__dict__ and a NamedTuple's public _replace and _asdict are not
    assert [f.what for f in top.foreign_underscores] == ["b._y", "b._z"]
    assert [str(f) for f in top.private_imports] == ["pkg/a.py:1: from pkg.b import _private"]
    assert [f.what for f in sub.long_functions] == ["long: 62 lines"]
    assert not top.long_functions and not sub.private_imports
    # a limit above the function's length counts nothing
    assert not structure.measure(("pkg",), tmp_path, max_lines=62)["pkg.sub"].long_functions


def test_import_picture(structure: ModuleType, tmp_path: Path) -> None:
    _write(tmp_path, TREE)
    picture = structure.import_picture("pkg", tmp_path)
    assert picture.rooms == ("a", "b", "e", "sub")
    # a relative import resolves to its room; inside a subpackage arrows are not between rooms
    assert picture.arrows == (("a", "b"), ("a", "sub"), ("b", "a"), ("e", "a"))
    assert picture.loops == (("a", "b"),)


# x and y import each other when x's function runs; t and u only for type checkers
CIRCLES = {
    "q/__init__.py": "",
    "q/x.py": "def f():\n    from q import y\n    return y\n",
    "q/y.py": "import q.x\n",
    "q/t.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from q.u import U\n",
    "q/u.py": "from q.t import T\n",
}


def test_file_loops_count_imports_that_run(structure: ModuleType, tmp_path: Path) -> None:
    _write(tmp_path, CIRCLES)
    picture = structure.import_picture("q", tmp_path)
    assert picture.files == 5
    # an import inside a function runs when it is called: x <-> y is a loop; an import
    # under TYPE_CHECKING never runs: t <-> u is none
    assert picture.file_loops == (("q.x", "q.y"),)
    assert picture.loops == (("t", "u"), ("x", "y"))  # rooms count type hints too
    # and so does the stricter file figure: t and u cannot be read one without the other
    assert picture.hinted_file_loops == (("q.t", "q.u"), ("q.x", "q.y"))
    # inside a subpackage the files still loop, though the rooms do not
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/sub/__init__.py": "",
                      "pkg/sub/c.py": "from . import d\n", "pkg/sub/d.py": "from . import c\n"})
    nested = structure.import_picture("pkg", tmp_path)
    assert nested.loops == () and nested.file_loops == (("pkg.sub.c", "pkg.sub.d"),)


def test_the_command_prints_the_table(structure: ModuleType, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    assert structure.main([]) == 0
    out = capsys.readouterr().out
    assert "| kvcache.core |" in out and "harness:" in out and "rooms" in out
    assert "harness.conform:" in out and "file loops" in out and "counting type hints" in out


def test_the_repository_keeps_the_rules_architecture_md_states(structure: ModuleType) -> None:
    """This checkout, measured: no function over 60 lines in the cache core or the engine,
    no other object's underscore fields touched in the core, no module importing another's
    private names, no import loop between the rooms of kvcache/ or harness/, and no two
    files that import each other, not even through type hints."""
    figures = structure.measure()
    for package in ("kvcache.core", "kvcache.engine"):
        assert [str(f) for f in figures[package].long_functions] == [], package
    assert [str(f) for f in figures["kvcache.core"].foreign_underscores] == []
    assert [str(f) for figs in figures.values() for f in figs.private_imports] == []
    for package in structure.PICTURES:
        picture = structure.import_picture(package)
        assert (picture.loops, picture.file_loops, picture.hinted_file_loops) == ((), (), ()), \
            package

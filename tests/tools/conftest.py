"""Fixtures for the tests of the tool scripts (tools/): each as a module, and for
tools/mutants.py and tools/gate_bench.py a small git repository with a catalogue of three
mutants."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.tool_scripts import TOOLS, load_tool

MUTANTS_TOOL = TOOLS / "mutants.py"

CALC = """\
def add(a, b):
    return a + b


def double(x):
    return 2 * x


def square(x):
    return x * x
"""

CALC_TESTS = """\
from calc import add, square


def test_add():
    assert add(2, 3) == 5


def test_add_slowly():
    assert add(1, 1) == 2


def test_square():
    assert square(3) == 9
"""

CATALOGUE = """\
mutants:
- id: add-minus
  file: calc.py
  find: "return a + b"
  replace: "return a - b"
  models: addition subtracts
  area: core
- id: double-plus
  file: calc.py
  find: "return 2 * x"
  replace: "return 2 + x"
  models: no test calls double
  area: core
- id: square-pow
  file: calc.py
  find: "return x * x"
  replace: "return x ** 2"
  models: the same function written otherwise
  area: core
  equivalent: x ** 2 equals x * x for every number
"""

# What the kill matrix reads to leave out slow tests: test_add_slowly is "slow".
DURATIONS = {"tests/test_calc.py::test_add": 0.01, "tests/test_calc.py::test_add_slowly": 5.0,
             "tests/test_calc.py::test_square": 0.01}


@pytest.fixture(scope="session")
def mutants() -> ModuleType:
    """tools/mutants.py."""
    return load_tool(MUTANTS_TOOL, "mutants_tool")


@pytest.fixture(scope="session")
def generic_mutants() -> ModuleType:
    """tools/generic_mutants.py (which imports tools/mutants.py by its script name)."""
    sys.modules.setdefault("mutants", load_tool(MUTANTS_TOOL, "mutants"))
    return load_tool(TOOLS / "generic_mutants.py", "generic_mutants_tool")


@pytest.fixture(scope="session")
def gate_bench() -> ModuleType:
    """tools/gate_bench.py."""
    return load_tool(TOOLS / "gate_bench.py", "gate_bench_tool")


@pytest.fixture(scope="session")
def structure() -> ModuleType:
    """tools/structure.py."""
    return load_tool(TOOLS / "structure.py", "structure_tool")


@pytest.fixture
def calc_repo(tmp_path: Path) -> Path:
    """A git repository: calc.py, its tests, a durations file and mutants.yaml (staged)."""
    root = tmp_path / "repo"
    (root / "tests").mkdir(parents=True)
    (root / "test_lists").mkdir()
    (root / "calc.py").write_text(CALC)
    (root / "tests" / "test_calc.py").write_text(CALC_TESTS)
    (root / "test_lists" / ".test_durations").write_text(json.dumps(DURATIONS))
    (root / "mutants.yaml").write_text(CATALOGUE)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "."], cwd=root, check=True)
    return root

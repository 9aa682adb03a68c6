"""`load_tool`: a script of tools/ (no package) imported as a module, once a session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(path: Path, name: str) -> ModuleType:
    """The tool script at `path`, imported as module `name`; the module already imported
    under that name when there is one, so the tests of tools/ and the rooms tests share
    one tools/structure.py and its cache of parsed files."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module

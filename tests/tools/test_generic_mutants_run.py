"""tools/generic_mutants.py end to end (post-merge, about a minute; needs the `mutation`
extra): mutmut's mutants of kvcache/core/validate.py against the config tests, in a copy
of this checkout, which stays as it was."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mutmut") is None,
                                reason="mutmut is not installed (pip install -e '.[mutation]')")


def test_the_core_validation_is_mutated_and_judged(generic_mutants: ModuleType,
                                                   tmp_path: Path) -> None:
    root = Path(generic_mutants.ROOT)
    before = subprocess.run(["git", "status", "--porcelain"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    code = generic_mutants.main(["--only", "kvcache/core/validate.py",
                                 "--tests", "tests/unit/core/test_cache_config.py",
                                 "--out", str(tmp_path), "--children", "2"])
    assert code == 0, (tmp_path / "mutmut.log").read_text()[-2000:]
    report = json.loads((tmp_path / "generic.json").read_text())
    rows, figures = report["mutants"], report["summary"]
    assert rows and {r["file"] for r in rows} == {"kvcache/core/validate.py"}
    # The bounds checks are what the config tests pin down: a mutant of them is killed.
    assert any(r["status"] == "killed" and "check_int" in r["name"] for r in rows)
    assert figures["killed"] + figures["by_status"].get("survived", 0) <= figures["counted"]
    for row in rows:
        assert (row["diff"] is not None) == (row["status"] == "survived")
        if row["diff"] is not None:
            assert row["diff"].startswith("--- kvcache/core/validate.py")
    assert "kvcache/core/validate.py" in (tmp_path / "generic.md").read_text()
    after = subprocess.run(["git", "status", "--porcelain"], cwd=root, check=True,
                           capture_output=True, text=True).stdout
    assert after == before  # mutated in a copy only

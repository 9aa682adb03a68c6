"""A lock's `stubs.overrides`: keys into the harness's own registry (`stubs.OVERRIDES`),
never code the file names; a bad key or an override without its primed raising stub is
refused naming the file and the field; applied, transformers' torchvision backend check
answers "available" while torchvision stays a raising stub (run in a child interpreter:
the override mutates transformers for the process); the report lists it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from harness.conform.controller.locks import LOCK_DIR, LockError, load_lock, lock_data, parse_lock
from harness.conform.controller.report import Report, markdown
from harness.conform.stubs import OVERRIDES, StubSpec

KEY = "transformers-torchvision-backend"
LOCK_018 = LOCK_DIR / "sglang-0.5.18.json"


def _lock(stubs: dict[str, Any]) -> dict[str, Any]:
    data = json.loads(LOCK_018.read_text())
    return {**data, "stubs": {**data["stubs"], **stubs}}


@pytest.mark.parametrize(("stubs", "message"), [
    pytest.param({"overrides": ["transformers.utils.import_utils"]},
                 r"sglang-0\.5\.18\.json: stubs: stubs\.overrides: "
                 r"'transformers\.utils\.import_utils' is not an override the harness knows; "
                 r"known: \['transformers-torchvision-backend'\]", id="unknown-key"),
    pytest.param({"overrides": [7]}, r"stubs\.overrides: 7 is not an override", id="not-a-key"),
    pytest.param({"overrides": [KEY], "prime": []},
                 r"sglang-0\.5\.18\.json: stubs: stubs\.overrides: "
                 r"'transformers-torchvision-backend' needs 'torchvision' raising and primed",
                 id="unprimed"),
])
def test_a_bad_override_is_refused_naming_the_file_and_field(stubs: dict[str, Any],
                                                             message: str) -> None:
    with pytest.raises(LockError, match=message):
        parse_lock(_lock(stubs), LOCK_018)


def test_the_registry_says_what_each_override_replaces() -> None:
    override = OVERRIDES[KEY]
    assert override.target == "transformers.utils.import_utils.BACKENDS_MAPPING['torchvision']"
    assert override.stub == "torchvision"
    assert "stays a raising stub" in override.what


def test_overrides_round_trip_and_appear_only_where_named() -> None:
    lock = load_lock(LOCK_018)
    assert lock.stubs.overrides == (KEY,)
    assert lock_data(lock)["stubs"]["overrides"] == [KEY]
    assert "overrides" not in StubSpec(raising={"gpu": "x"}).as_dict()


# the child: prime, install the stubs with the override, then report what transformers
# and torchvision say
_CHILD = textwrap.dedent("""
    import json, sys
    import transformers.utils.import_utils as iu
    from harness.conform.stubs import StubSpec, StubUsedError, install
    primed = iu.is_torchvision_available()
    spec = StubSpec.from_dict(json.loads(sys.argv[1]))
    install(spec)
    import torchvision
    try:
        torchvision.ops
        touched = "no"
    except StubUsedError as exc:
        touched = exc.stub
    iu.requires_backends(object, ["torchvision"])  # refused before the override
    print(json.dumps({"primed": primed, "backend": iu.BACKENDS_MAPPING["torchvision"][0](),
                      "probe": iu.is_torchvision_available(), "touched": touched}))
""")


def _child(stubs: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, json.dumps(stubs)],
                          capture_output=True, text=True, check=False,
                          cwd=Path(__file__).parents[3])


def test_the_override_answers_the_backend_check_and_torchvision_stays_a_stub() -> None:
    pytest.importorskip("transformers.utils.import_utils")
    stubs = {"raising": {"torchvision": "a CUDA build"}, "prime": ["torchvision"],
             "overrides": [KEY]}
    done = _child(stubs)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got == {"primed": False, "backend": True, "probe": False,
                   "touched": "torchvision.ops"}
    # without it transformers refuses, as it does SGLang 0.5.12-0.5.21's registration
    plain = _child({**stubs, "overrides": []})
    assert plain.returncode != 0 and "requires the Torchvision library" in plain.stderr


def test_the_report_lists_the_override() -> None:
    report = Report("sglang==0.5.18", "sglang", "0.5.18")
    report.source = {"kind": "release", "lock": str(LOCK_018), "committed": True,
                     "overrides": {KEY: "what it replaces"}}
    assert f"Override `{KEY}` (the lock's `stubs.overrides`): what it replaces" \
        in markdown(report)

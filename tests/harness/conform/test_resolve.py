"""Resolving a lock from a wheel's metadata, the parts that need no engine and no
registry: the engine's own specifiers, Requires-Python, module -> distribution, what
pip's resolver is asked and what its report pins, and what the next round changes after
the worker's load fails (a stub borrowed, a package added, a stub name, or the end)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from harness.conform.controller.locks import (
    DEFAULT_PYTHON,
    LOCK_DIR,
    load_lock,
    lock_name,
    never_pinned,
)
from harness.conform.controller.resolve import (
    ResolveError,
    admits,
    module_distribution,
    next_round,
    pins_from_report,
    request_lines,
    requirements,
    requires_python,
)
from harness.conform.stubs import StubSpec

METADATA = """\
Metadata-Version: 2.4
Name: vllm
Version: 0.30.0
Requires-Python: <3.15,>=3.10
Requires-Dist: regex
Requires-Dist: transformers<5.21.0,>=5.16.1
Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0
Requires-Dist: protobuf>=5.29.6; platform_machine != "s390x"
Requires-Dist: protobuf==7.36.1; platform_machine == "s390x"
Requires-Dist: pyzmq>=25.0.0
Requires-Dist: torch==2.14.0
Requires-Dist: tensorizer==2.10.1; extra == "tensorizer"
Requires-Dist: Py_Cpuinfo (>=9)

vLLM's description, which is not a header.
"""


def test_the_engines_own_specifiers_are_read_without_extras() -> None:
    got = requirements(METADATA)
    assert got["transformers"] == ["transformers<5.21.0,>=5.16.1"]
    assert got["fastapi"] == ["fastapi<0.137.0,>=0.133.0"]  # the extra's packages stay out
    assert got["protobuf"] == ['protobuf>=5.29.6 ; platform_machine != "s390x"',
                               'protobuf==7.36.1 ; platform_machine == "s390x"']
    assert got["py-cpuinfo"] == ["Py_Cpuinfo>=9"]  # names normalised, parentheses dropped
    assert "tensorizer" not in got  # only under an extra
    assert requires_python(METADATA) == "<3.15,>=3.10"


@pytest.mark.parametrize(("specifier", "python", "ok"), [
    pytest.param("<3.15,>=3.10", "3.11", True, id="inside"),
    pytest.param(">=3.12", "3.11", False, id="too-old"),
    pytest.param("<3.12,>=3.9", "3.12", False, id="too-new"),
    pytest.param("==3.11.*", "3.11", True, id="wildcard"),
    pytest.param("!=3.12.*,>=3.10", "3.12", False, id="excluded"),
    pytest.param(None, "3.12", True, id="none"),
])
def test_requires_python_decides_the_interpreter(specifier: str | None, python: str,
                                                 ok: bool) -> None:
    assert admits(specifier, python) is ok


def test_a_closure_name_takes_the_engines_specifier_or_stays_bare() -> None:
    got = request_lines(["transformers", "PyYAML", "py_cpuinfo"], requirements(METADATA))
    assert got == ["transformers<5.21.0,>=5.16.1", "PyYAML", "Py_Cpuinfo>=9"]


@pytest.mark.parametrize(("module", "dist"), [
    pytest.param("zmq.asyncio", "pyzmq", id="known-pair"),
    pytest.param("regex", "regex", id="engine-requirement"),
    pytest.param("cpuinfo", "py-cpuinfo", id="known-pair-2"),
    pytest.param("blake3", "blake3", id="own-name"),
])
def test_a_missing_module_maps_to_its_distribution(module: str, dist: str) -> None:
    assert module_distribution(module, requirements(METADATA)) == dist


def _item(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "version": version}, "download_info": {}}


def test_the_resolvers_report_is_pinned_but_torch_and_cuda() -> None:
    report = {"version": "1", "install": [
        _item("transformers", "5.20.2"), _item("torch", "2.14.0"),
        _item("nvidia-cublas-cu12", "12.8.4.1"), _item("Pygments", "2.21.0"),
        _item("aiohttp", "3.14.5")]}
    assert pins_from_report(report, never_pinned) == [
        "aiohttp==3.14.5", "Pygments==2.21.0", "transformers==5.20.2"]


def _round(problem: str, engine: str, version: str, names: list[str] | None = None,
           cmd: str = "load") -> tuple[list[str], StubSpec, str]:
    start = load_lock(LOCK_DIR / lock_name(engine, "0.5.5" if engine == "sglang" else "0.28.0",
                                           DEFAULT_PYTHON))
    names = [p.split("==")[0] for p in start.deps] if names is None else names
    return next_round(f"{cmd}: {problem}\ntraceback", engine, version, names, start.stubs,
                      requirements(METADATA), start, LOCK_DIR)


def test_a_gpu_package_the_import_misses_is_stubbed_as_the_nearest_lock_stubs_it() -> None:
    names, stubs, what = _round("ModuleNotFoundError: No module named 'sgl_kernel.kvcacheio'",
                                "sglang", "0.5.7")
    assert "sgl_kernel" in stubs.raising and "sgl-kernel" not in names
    assert "transfer_kv_per_layer" in stubs.names["sgl_kernel.kvcacheio"]
    source = re.fullmatch(r"stub sgl_kernel as (\S+)'s lock has it", what)
    assert source is not None  # the nearest committed lock with the stub (0.5.10 first had it)
    assert "sgl_kernel" in load_lock(LOCK_DIR / lock_name("sglang", source[1],
                                                          DEFAULT_PYTHON)).stubs.raising


def test_a_pure_package_the_import_misses_is_added_by_name() -> None:
    names, stubs, what = _round("ModuleNotFoundError: No module named 'cpuinfo'", "vllm",
                                "0.30.0", names=["regex"])
    assert names == ["regex", "py-cpuinfo"] and not stubs.raising
    assert what == "py-cpuinfo (the import asked for cpuinfo)"


def test_a_name_imported_from_a_raising_stub_joins_its_names() -> None:
    problem = ("StubUsedError: torchvision.io.decode_png: torchvision.io is a stub (the "
               "PyPI wheel is a CUDA build)")
    _, stubs, what = _round(problem, "sglang", "0.5.7")
    assert stubs.names["torchvision.io"] == ("decode_jpeg", "decode_png")
    assert what == "stub name torchvision.io.decode_png (imported at module level)"


@pytest.mark.parametrize(("problem", "message"), [
    pytest.param("ModuleNotFoundError: No module named 'regex'", r"the import still misses "
                 r"'regex' with regex installed", id="still-missing"),
    pytest.param("ImportError: cannot import name 'X' from 'sglang.srt.utils'",
                 r"sglang 0\.5\.7 does not load with the stubs of 0\.5\.5's lock and its "
                 r"closure; write its lock by hand", id="anything-else"),
    pytest.param("ModuleNotFoundError: No module named 'sglang.srt.gone'",
                 r"write its lock by hand", id="the-engines-own-module"),
])
def test_a_failure_nothing_reliable_fixes_ends_the_resolution(problem: str,
                                                              message: str) -> None:
    with pytest.raises(ResolveError, match=message):
        _round(problem, "sglang", "0.5.7", names=["regex"])


@pytest.mark.parametrize(("engine", "version", "adapter"), [
    pytest.param("sglang", "0.5.8.post1", "sglang_radix", id="sglang"),
    pytest.param("vllm", "0.30.0", "vllm_scheduler", id="vllm"),
])
def test_an_api_the_adapter_does_not_follow_is_named_as_the_adapters(
        engine: str, version: str, adapter: str) -> None:
    """The file named is the module the engine's worker loads (`ADAPTERS`), which need
    not be named for the engine."""
    with pytest.raises(ResolveError, match=rf"{engine} {re.escape(version)} loads, but the "
                       r"adapter's probe of its API fails: the adapter \(harness/conform/"
                       rf"adapters/{adapter}\.py\) needs to follow this release"):
        _round("AttributeError: 'RadixKey' object has no attribute 'key'", engine, version,
               cmd="selftest")
    assert (Path(__file__).parents[3] / "harness/conform/adapters" / f"{adapter}.py").is_file()

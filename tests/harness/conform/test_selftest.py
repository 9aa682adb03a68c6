"""The self-test refuses a mocked, stubbed or foreign engine function, and a mock in a
result; the stubs raise on any use and leave absent modules absent."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import unittest.mock
from collections.abc import Iterator

import pytest

from harness.conform.adapters.kvcache import PACKAGE_MODULES, KvcacheCache, package_dir
from harness.conform.stubs import (
    StubFinder,
    StubSpec,
    StubUsedError,
    install,
    is_stub,
    raising_function,
)
from harness.conform.worker.selftest import check_callables, find_mocks, self_test


def test_kvcache_passes_and_every_substitute_is_refused() -> None:
    got = self_test(KvcacheCache(16, 4), package_dir(), PACKAGE_MODULES)
    assert got.problems == []
    assert got.sources["add_sequence"].endswith("kvcache/core/manager.py")
    assert got.substitutes == 3 * len(got.sources)
    # what a report names as the engine code each op goes through
    assert got.functions["add_sequence"] == "kvcache/core/manager.py: KvCacheManager.add_sequence"
    assert got.calls["admit"] == ["add_sequence", "take_copy_ops"]


class _CallsUnknown(KvcacheCache):
    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        return {**super().engine_calls(), "admit": ("add_sequence", "lookup"), "flush": ()}


def test_an_op_said_to_go_through_a_function_the_adapter_does_not_name_is_refused() -> None:
    problems = self_test(_CallsUnknown(16, 4), package_dir(), PACKAGE_MODULES).problems
    assert problems == ["engine_calls: 'flush' is not an op kind",
                        "engine_calls['admit']: 'lookup' is not one of engine_callables()"]


@pytest.mark.parametrize("fake", [
    pytest.param(unittest.mock.MagicMock(), id="magicmock"),
    pytest.param(raising_function("kvcache.core.manager.commit", "test"), id="raising-stub"),
    pytest.param(lambda *a, **k: None, id="foreign-lambda"),
])
def test_a_substituted_method_is_refused(fake: object) -> None:
    cache = KvcacheCache(16, 4)
    cache.manager.commit = fake  # type: ignore[method-assign]
    problems = self_test(cache, package_dir(), PACKAGE_MODULES).problems
    assert len(problems) == 1 and problems[0].startswith("commit: ")
    assert any(word in problems[0] for word in ("stub or a mock", "outside"))


def test_a_mock_deep_in_a_result_is_found() -> None:
    value = {"blocks": [1, (2, unittest.mock.MagicMock())], "stats": {"hits": 3}}
    assert find_mocks(value, "probe") == ["probe['blocks'][1][1]: MagicMock"]
    assert find_mocks({"a": [1, 2]}) == []


def test_a_method_defined_outside_the_package_is_named() -> None:
    class Fake:
        def commit(self) -> None: ...
    problems, _ = check_callables({"commit": (Fake(), "commit")}, package_dir())
    assert problems and "outside" in problems[0] and "test_selftest.py" in problems[0]


@pytest.fixture
def stubbed() -> Iterator[StubFinder]:
    spec = StubSpec(absent={"kvh_absent_gpu": "not here", "kvh_gpu.kernels": "no CPU build"},
                    raising={"kvh_gpu": "CUDA only"}, names={"kvh_gpu.ops": ("launch",)})
    finder = install(spec)
    yield finder
    sys.meta_path.remove(finder)
    for name in [m for m in sys.modules if m.startswith("kvh_")]:
        del sys.modules[name]


def test_a_raising_stub_raises_on_any_use(stubbed: StubFinder) -> None:
    mod = importlib.import_module("kvh_gpu.ops")
    assert is_stub(mod) and stubbed.served == ["kvh_gpu", "kvh_gpu.ops"]
    with pytest.raises(StubUsedError, match=r"kvh_gpu\.ops\.anything: kvh_gpu\.ops is a stub "
                                            r"\(CUDA only\)"):
        mod.anything  # noqa: B018
    with pytest.raises(StubUsedError):
        hasattr(mod, "x")  # a probe raises too, never a quiet False
    with pytest.raises(StubUsedError, match=r"kvh_gpu\.ops\.launch\(\) was called"):
        mod.launch()


def test_an_absent_module_is_missing_even_below_a_raising_stub(stubbed: StubFinder) -> None:
    assert importlib.util.find_spec("kvh_absent_gpu") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvh_absent_gpu")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvh_gpu.kernels")


def test_stubs_installed_late_or_over_an_installed_module_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\['json', .* are already imported"):
        install(StubSpec(raising={"json": "x"}))
    with pytest.raises(ValueError, match=r"\['this'\] must be absent but are installed"):
        install(StubSpec(absent={"this": "x"}))


@pytest.mark.parametrize(("data", "message"), [
    pytest.param({"raising": {"a b": "x"}}, r"'a b' is not a dotted module name", id="name"),
    pytest.param({"raising": {"gpu": ""}}, r"give the reason", id="no-reason"),
    pytest.param({"names": {"gpu.ops": ["f"]}}, r"not inside a raising stub", id="names"),
    pytest.param({"absent": {"numpy.linalg": "x"}}, r"a submodule is absent only inside",
                 id="absent-submodule"),
    pytest.param({"mock": {}}, r"unknown keys \['mock'\]", id="unknown"),
])
def test_a_bad_stub_list_is_refused(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StubSpec.from_dict(data)

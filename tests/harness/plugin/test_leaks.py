"""Leak checks after cache-owning tests: the CacheOwner protocol, found through fixture
values (owners, factories with cache_owners(), engines through `manager` or
`cache_manager`), with a tiny test double for the protocol, the real KvCacheManager and
a bare kvcache.Engine."""

from __future__ import annotations

import textwrap
from unittest.mock import MagicMock

import pytest

from harness.plugin.leaks import CacheOwner, find_cache_owners, is_cache_owner, leak_problems
from harness.reuse.adapters import KvcacheEngineAdapter
from kvcache import Engine, KvCacheConfig, KvCacheManager

pytest_plugins = ["pytester"]

OWNERS = """\
import pytest
from unittest.mock import MagicMock
from kvcache import KvCacheManager, KvCacheConfig


class FakeOwner:
    # A test double for the CacheOwner protocol: leaks and breakage on demand.
    def __init__(self, leaks=(), broken=None):
        self.leaks, self.broken = list(leaks), broken

    def check_integrity(self):
        if self.broken:
            raise AssertionError(self.broken)

    def leak_report(self):
        return list(self.leaks)


class Factory:
    def __init__(self):
        self.made = []

    def make(self, leaks):
        self.made.append(FakeOwner(leaks))

    def cache_owners(self):
        return self.made


class Engine:
    def __init__(self):
        self.cache_manager = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8))


@pytest.fixture
def clean(): return FakeOwner()

@pytest.fixture
def leaky(): return FakeOwner(["block 3 held by seq 7"])

@pytest.fixture
def broken(): return FakeOwner(broken="ref count of block 2 is -1")

@pytest.fixture
def freed_in_teardown():
    owner = FakeOwner(["seq 1 live"])
    yield owner
    owner.leaks.clear()

@pytest.fixture
def factory(): return Factory()

@pytest.fixture
def engine(): return Engine()

@pytest.fixture
def mgr(): return KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8))

@pytest.fixture
def mock(): return MagicMock()


def test_clean(clean): pass
def test_leaky(leaky): pass
def test_broken(broken): pass
def test_freed_in_teardown(freed_in_teardown): pass
def test_factory(factory): factory.make([]); factory.make(["seq 3 live"])
def test_failing_is_not_checked(leaky): assert False
def test_mock_is_no_owner(mock): pass
def test_real_leak(mgr): mgr.add_sequence(1, list(range(1, 10)))
def test_real_clean(mgr): mgr.add_sequence(1, list(range(1, 10))); mgr.free_sequence(1)
def test_engine_leak(engine): engine.cache_manager.add_sequence(2, list(range(1, 6)))
"""


def test_plugin_errors_in_teardown_with_what_leaked(quiet_pytester: pytest.Pytester) -> None:
    quiet_pytester.makepyfile(test_owners=OWNERS)
    result = quiet_pytester.runpytest()
    result.assert_outcomes(passed=9, failed=1, errors=6)
    errors = {r.nodeid.split("::")[1]: r.longreprtext
              for r in result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
              if r.when == "teardown" and r.failed}
    assert sorted(errors) == ["test_broken", "test_engine_leak", "test_factory",
                              "test_freed_in_teardown", "test_leaky", "test_real_leak"]
    expected = {
        "test_leaky": "leaky (FakeOwner): leaked: block 3 held by seq 7",
        "test_broken": "broken (FakeOwner): check_integrity() failed: AssertionError: "
                       "ref count of block 2 is -1",
        "test_freed_in_teardown": "freed_in_teardown (FakeOwner): leaked: seq 1 live",
        "test_factory": "factory.cache_owners()[1] (FakeOwner): leaked: seq 3 live",
        "test_real_leak": "mgr (KvCacheManager): leaked: sequence 1 is still live, holding 3 blocks",
        "test_engine_leak": "engine.cache_manager (KvCacheManager): leaked: sequence 2 is still "
                            "live",
    }
    for name, line in expected.items():
        assert line in errors[name], errors[name]
        assert "left its cache unclean (1 problems)" in errors[name]


class _Owner:
    def __init__(self, report: object) -> None:
        self.report = report

    def check_integrity(self) -> None:
        """Always intact."""

    def leak_report(self) -> object:
        return self.report


def test_protocol_is_structural_and_ignores_mocks() -> None:
    manager = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8))
    assert is_cache_owner(manager) and isinstance(manager, CacheOwner)
    assert is_cache_owner(_Owner([]))
    assert not is_cache_owner(MagicMock())
    assert not is_cache_owner(object())


def test_owners_are_found_once_each() -> None:
    manager = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8))

    class Engine:
        cache_manager = manager

    found = find_cache_owners({"mgr": manager, "engine": Engine(), "n": 3})
    assert found == [("mgr", manager)]


BARE_ENGINES = """\
import pytest
from kvcache import Engine, KvCacheConfig


class Factory:
    def __init__(self):
        self.made = []

    def __call__(self):
        self.made.append(Engine("tiny", KvCacheConfig(tokens_per_block=4, max_num_blocks=64)))
        return self.made[-1]

    def cache_owners(self):
        return self.made  # engines, not their managers: reached through engine.manager


@pytest.fixture
def engine():
    return Engine("tiny", KvCacheConfig(tokens_per_block=4, max_num_blocks=64))

@pytest.fixture
def engines(): return Factory()


def test_unfinished_request(engine):
    engine.add_request(list(range(1, 10)), max_new_tokens=4)
    engine.step()  # admitted and prefilled; still running when the test ends

def test_finished(engine):
    engine.generate([list(range(1, 10))], max_new_tokens=2)

def test_factory_of_engines(engines):
    engines().generate([[1, 2, 3]], max_new_tokens=1)
    leaky = engines()
    leaky.add_request([4, 5, 6, 7, 8], max_new_tokens=4)
    leaky.step()
"""


def test_a_leaking_bare_engine_fixture_errors(quiet_pytester: pytest.Pytester) -> None:
    quiet_pytester.makepyfile(test_engines=BARE_ENGINES)
    result = quiet_pytester.runpytest()
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_unfinished_request*",
        "*engine.manager (KvCacheManager): leaked: sequence 0 is still live, holding 3 blocks*",
        "*ERROR at teardown of test_factory_of_engines*",
        "*engines.cache_owners()?1?.manager (KvCacheManager): leaked: sequence 0 is still live*",
    ])
    result.stdout.no_fnmatch_line("*teardown of test_finished*")


def test_engines_and_adapters_are_found_through_their_attributes() -> None:
    engine = Engine("tiny", KvCacheConfig(tokens_per_block=4, max_num_blocks=8))
    adapter = KvcacheEngineAdapter(engine)
    assert find_cache_owners({"engine": engine}) == [("engine.manager", engine.manager)]
    assert find_cache_owners({"adapter": adapter}) == [("adapter.cache_manager", engine.manager)]
    # the same cache behind two fixtures is checked once, under the first name
    assert find_cache_owners({"engine": engine, "adapter": adapter}) == [
        ("engine.manager", engine.manager)]

    class NotAnEngine:
        manager = "a manager of something else"

    assert find_cache_owners({"x": NotAnEngine(), "mock": MagicMock()}) == []


def test_bad_leak_reports_are_problems_not_crashes() -> None:
    problems = leak_problems([("odd", _Owner("not a list"))])  # type: ignore[list-item]
    assert problems == ["odd (_Owner): leak_report() returned a str, expected a list of strings"]


def test_cache_owners_yielding_a_non_owner_is_a_type_error() -> None:
    class Factory:
        def cache_owners(self) -> list[object]:
            return [object()]

    with pytest.raises(TypeError, match=r"f\.cache_owners\(\)\[0\] is a object, which lacks"):
        find_cache_owners({"f": Factory()})


def test_a_factory_error_is_reported_in_teardown(quiet_pytester: pytest.Pytester) -> None:
    quiet_pytester.makepyfile(test_bad=textwrap.dedent("""\
        import pytest
        class Factory:
            def cache_owners(self): return [3]
        @pytest.fixture
        def factory(): return Factory()
        def test_x(factory): pass
        """))
    result = quiet_pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*factory.cache_owners()?0? is a int, which lacks*"])

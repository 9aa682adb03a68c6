"""Fail-first order (issue 26): the ranking from durations and a kill record, the prior
without one, and the plugin's --kvh-order and the lists' `order:` in pytest runs over a
small project: serial runs in this process (pytester's in-process runs), and one real
pytest process under pytest-xdist with the pre-merge session's flags: the order is the
derived one, every selected test runs once, and the leak check reports the same. `-x`
under pytest-xdist, a second process, runs post-merge (`..._wide`)."""

from __future__ import annotations

import ast
import itertools
import json
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from harness.plugin.ordering import MIN_SECONDS, PriorWeights, fail_first

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[3]
IDS = [f"t.py::test_{c}" for c in "abcdef"]
DURATIONS = {"t.py::test_a": 1.0, "t.py::test_b": 0.1, "t.py::test_c": 2.0,
             "t.py::test_d": 0.5, "t.py::test_e": 0.5}  # test_f: no duration
KILLS = {"m1": ["t.py::test_a", "t.py::test_c"], "m2": ["t.py::test_c"],
         "m3": ["t.py::test_a", "t.py::test_b"], "m4": [], "m5": ["t.py::gone"]}


def test_greedy_by_new_kills_per_second_then_the_rest() -> None:
    order = fail_first(IDS, DURATIONS, KILLS, {})
    # b kills m3 in 0.1 s (10/s); then a adds m1 (1/s) and c adds m2 (0.5/s); d, e and f
    # kill nothing and follow longest first: f (no duration: the mean, 0.82 s), then d and
    # e (0.5 s each), by id.
    assert order == ["t.py::test_b", "t.py::test_a", "t.py::test_c",
                     "t.py::test_f", "t.py::test_d", "t.py::test_e"]


def test_a_test_that_adds_nothing_waits_for_the_rest() -> None:
    # a kills only what b already killed: after b it adds nothing, so c (m2) goes first,
    # and a follows among the rest by its total kills per second.
    kills = {"m1": ["t.py::test_a", "t.py::test_b"], "m2": ["t.py::test_c"]}
    assert fail_first(IDS, DURATIONS, kills, {})[:3] == [
        "t.py::test_b", "t.py::test_c", "t.py::test_a"]


def test_the_order_depends_on_the_files_only() -> None:
    first = fail_first(IDS, DURATIONS, KILLS, {"t.py::test_d": 1})
    for shuffled in itertools.islice(itertools.permutations(IDS), 0, 720, 97):
        assert fail_first(list(shuffled), DURATIONS, KILLS, {"t.py::test_d": 1}) == first
    assert sorted(first) == sorted(IDS)


def test_stale_ids_in_the_files_are_ignored() -> None:
    stale = {**DURATIONS, "gone.py::test_x": 0.001}
    assert fail_first(IDS, stale, {**KILLS, "m6": ["gone.py::test_x"]}, {}) == fail_first(
        IDS, DURATIONS, KILLS, {})


def test_without_a_kill_record_the_prior_weighs_per_second() -> None:
    prior = {"t.py::test_a": 3, "t.py::test_c": 3, "t.py::test_d": 1, "t.py::test_f": 0}
    # a 3/s, c 1.5/s, d 2/s; b and e weigh 0 (tests that cannot see a cache bug): last
    # with f, longest first (f 0.82 s, e 0.5 s, b 0.1 s), so the workers of a parallel run
    # end on short tests together.
    assert fail_first(IDS, DURATIONS, None, prior) == [
        "t.py::test_a", "t.py::test_d", "t.py::test_c",
        "t.py::test_f", "t.py::test_e", "t.py::test_b"]


def test_recorded_times_below_pytests_own_cost_count_as_that_cost() -> None:
    durations = {"t.py::test_a": 0.0001, "t.py::test_b": MIN_SECONDS}
    # 50 times cheaper on paper, equal in a run: the higher weight goes first.
    assert fail_first(IDS[:2], durations, None, {"t.py::test_a": 1, "t.py::test_b": 2}) == [
        "t.py::test_b", "t.py::test_a"]


def test_the_prior_weighs_oracles_bound_by_cache_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    def module(name: str, **names: object) -> ModuleType:
        made = ModuleType(name)
        vars(made).update(names)
        monkeypatch.setitem(sys.modules, name, made)
        return made

    def from_module(origin: str) -> object:
        return type("Bound", (), {"__module__": origin})

    support = module("tests.support", index=from_module("harness.oracle.kv_index"))
    oracle_test = module("tests.test_oracle", KvCacheManager=from_module("kvcache.core.manager"),
                         checked=module("harness.oracle.checked_manager"),
                         run_steps=from_module("tests.support"), again=support)
    unit_test = module("tests.test_unit", kvcache=module("kvcache"))
    lists_test = module("tests.test_lists", db=module("harness.lists.db"))
    judge_test = module("tests.test_judge", Judge=from_module("harness.conform.controller.judge"),
                        oracle=from_module("harness.oracle.after_test"))
    docs_test = module("tests.test_docs", Path=from_module("pathlib"), pytest=pytest)
    prior = PriorWeights()
    assert prior.of(oracle_test) == 3  # the cache, the checked manager, the index via support
    assert prior.of(unit_test) == 1
    # The harness is code under test too: its lists as much as a cache unit test, the
    # judge and an oracle as two oracles.
    assert prior.of(lists_test) == 1
    assert prior.of(judge_test) == 3
    assert prior.of(docs_test) == 0  # binds neither the cache nor the harness
    assert prior.of(None) == 0


def test_the_prior_puts_oracle_and_fuzz_tests_above_unit_tests_and_harness_tests_beside_them(
        ) -> None:
    from tests.ci import test_docs
    from tests.harness.lists import test_db
    from tests.harness.oracle import test_capacity, test_checked_manager, test_provenance
    from tests.reliability import test_cache_fuzz
    from tests.unit.core import test_radix_keys

    prior = PriorWeights()
    unit = prior.of(test_radix_keys)
    assert prior.of(test_checked_manager) > unit and prior.of(test_cache_fuzz) > unit
    # The oracles' own tests weigh as much as the tests they judge (a broken oracle turns
    # every other test green), the lists' as a unit test; only what binds neither the
    # cache nor the harness (the docs) waits for the tail.
    assert prior.of(test_provenance) > unit and prior.of(test_capacity) > unit
    assert prior.of(test_db) == unit > prior.of(test_docs) == 0


def _fixture_scope(decorator: ast.expr) -> str | None:
    if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.fixture":
        for keyword in decorator.keywords:
            if keyword.arg == "scope" and isinstance(keyword.value, ast.Constant):
                return str(keyword.value.value)
    return None


def test_the_projects_shared_fixtures_survive_the_order() -> None:
    # The fail-first order interleaves modules, and pytest tears a module- or class-scoped
    # fixture down whenever the next test is elsewhere, and makes it again when the order
    # comes back (measured: test_scenario_records' 6 s pytest run of failing scenarios
    # took that module from 34 s to 97 s of a parallel run). What tests share, they share
    # for the session.
    scoped = [f"{path.relative_to(ROOT)}:{node.lineno} {scope}"
              for path in sorted((ROOT / "tests").rglob("*.py"))
              for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
              if isinstance(node, ast.FunctionDef)
              for scope in map(_fixture_scope, node.decorator_list)
              if scope in ("module", "class", "package")]
    assert scoped == []


# -- the plugin, in real pytest processes -------------------------------------------------

TESTS = textwrap.dedent("""\
    import os
    import pytest
    from kvcache import KvCacheManager, KvCacheConfig

    def _log(request):
        with open(os.environ["ORDER_LOG"], "a") as out:
            out.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {request.node.nodeid}\\n")

    @pytest.fixture
    def mgr():
        return KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8))

    @pytest.mark.parametrize("n", range(12))
    def test_n(n, request):
        _log(request)

    def test_leaky(mgr, request):
        _log(request)
        mgr.add_sequence(1, list(range(1, 10)))

    def test_clean(mgr, request):
        _log(request)
        mgr.add_sequence(1, list(range(1, 10)))
        mgr.free_sequence(1)
    """)
NODE_IDS = [f"tests/test_o.py::test_n[{n}]" for n in range(12)] + [
    "tests/test_o.py::test_leaky", "tests/test_o.py::test_clean"]
# A slow test that kills much and cheap ones that kill little, so the derived order is far
# from collection order; test_n[11] is in neither file (a new test).
RUN_DURATIONS = {n: 0.01 * (i % 5 + 1) for i, n in enumerate(NODE_IDS[:11])} | {
    NODE_IDS[12]: 0.5, NODE_IDS[13]: 0.02, "tests/test_gone.py::test_x": 0.001}
RUN_KILLS = {f"m{k}": [NODE_IDS[(3 * k + 7) % 11], NODE_IDS[12]] for k in range(6)} | {
    "m-stale": ["tests/test_gone.py::test_x"], "m-survived": []}
LIST = textwrap.dedent("""\
    version: 0.0.1
    l0_cpu:
    - condition:
        terms:
          stage: pre_merge
      order: fail-first
      tests:
      - tests/test_o.py
    """)


def _write_kills(where: Path, kills: dict[str, list[str]]) -> Path:
    path = where / ".test_kills.json"
    path.write_text(json.dumps({"mutants": kills}))
    return path


@pytest.fixture
def project(quiet_pytester: pytest.Pytester) -> pytest.Pytester:
    pytester = quiet_pytester
    pytester.mkdir("tests")
    (pytester.path / "tests" / "test_o.py").write_text(TESTS)
    (pytester.path / "lists" / "test-db").mkdir(parents=True)
    (pytester.path / "lists" / "test-db" / "l0_cpu.yml").write_text(LIST)
    (pytester.path / "lists" / ".test_durations").write_text(json.dumps(RUN_DURATIONS))
    _write_kills(pytester.path / "lists", RUN_KILLS)
    return pytester


def _run(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str,
         subprocess: bool = False) -> tuple[pytest.RunResult, list[tuple[str, str]]]:
    """pytest over `project` with its lists, in this process unless `subprocess`; returns
    the result and the (worker, node id) of each test in the order they ran."""
    log = project.path / f"order-{len(list(project.path.glob('order-*')))}.log"
    monkeypatch.setenv("ORDER_LOG", str(log))
    # This checkout's kvcache and plugin, not the installed ones (pytester puts its own
    # folder first).
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)  # when this test runs in an xdist worker
    run = project.runpytest_subprocess if subprocess else project.runpytest_inprocess
    result = run("--kvh-test-db", "lists/test-db", "-p", "no:randomly", *args)
    lines = log.read_text().splitlines() if log.exists() else []
    return result, [(w, n) for w, n in (line.split(" ", 1) for line in lines)]


FIRST_FAILURE = "kvharness: first failure * s into the run: tests/test_o.py::test_leaky (teardown)"


def _derived() -> list[str]:
    # test_o.py binds KvCacheManager and no oracle: a prior weight of 1 for every test.
    return fail_first(NODE_IDS, RUN_DURATIONS, {k: set(v) for k, v in RUN_KILLS.items()},
                      dict.fromkeys(NODE_IDS, 1))


def test_a_serial_run_keeps_the_derived_order(
        project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    derived = _derived()
    # The six cheap killers of one mutant each first, then the slow one that kills all six
    # (12 kills/s), then the rest by node id: far from collection order.
    assert derived.index("tests/test_o.py::test_leaky") == 6 and derived[1] != NODE_IDS[1]
    # `nox -s premerge -- -n 0`: the pre-merge session's flags, serially.
    serial, ran = _run(project, monkeypatch, *_nox_parallel_flags(), "-n", "0")
    assert [n for _, n in ran] == derived  # each test once, in the derived order
    assert {w for w, _ in ran} == {"main"}
    serial.assert_outcomes(passed=14, errors=1)
    serial.stdout.fnmatch_lines([FIRST_FAILURE, "*= ERRORS =*"])  # said at once, not at the end
    serial.stdout.fnmatch_lines(["*kvharness order: fail-first over 14 of 14 tests, by new "
                                 "kills per second of lists/.test_kills.json (8 mutants); "
                                 "durations from lists/.test_durations"])
    _assert_the_leak_is_reported(serial)


def _assert_the_leak_is_reported(result: pytest.RunResult) -> None:
    result.assert_outcomes(passed=14, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaky*",
                                 "*mgr (KvCacheManager): leaked: sequence 1 is still live, "
                                 "holding 3 blocks*"])

def _nox_parallel_flags() -> list[str]:
    """The pytest-xdist flags `nox -s premerge` runs with (noxfile.py's PARALLEL), read
    without importing nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    values = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              and ast.unparse(node.targets[0]) == "PARALLEL"]
    assert len(values) == 1, "noxfile.py defines PARALLEL once"
    return list(values[0])


def test_premerge_flags_keep_the_order_in_each_worker(
        project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = _nox_parallel_flags()
    assert flags[:2] == ["-n", "auto"]
    derived = _derived()
    # A real pytest process, as `nox -s premerge` starts it (its serial twin runs in
    # process: test_a_serial_run_keeps_the_derived_order).
    parallel, ran_n2 = _run(project, monkeypatch, *flags[2:], "-n", "2", subprocess=True)
    workers = {w for w, _ in ran_n2}
    assert workers == {"gw0", "gw1"}
    # Each worker runs a subsequence of the derived order; together, each test once.
    for worker in workers:
        mine = [n for w, n in ran_n2 if w == worker]
        assert mine == [n for n in derived if n in mine], worker
    assert sorted(n for _, n in ran_n2) == sorted(NODE_IDS)
    # xdist hands each worker two tests to start with (`load` never sends fewer): the
    # first test of each worker is among the first four of the derived order, the very
    # first among them.
    firsts = {next(n for w, n in ran_n2 if w == worker) for worker in workers}
    assert derived[0] in firsts and firsts <= set(derived[:4])
    _assert_the_leak_is_reported(parallel)  # as in a serial run, from a worker
    parallel.stdout.fnmatch_lines(["*kvharness order: fail-first over 14 of 14 tests, by new "
                                   "kills per second of lists/.test_kills.json (8 mutants)*"])
    parallel.stdout.fnmatch_lines([FIRST_FAILURE, "*= ERRORS =*"])


def test_x_stops_at_the_first_failure(
        project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    serial, ran = _run(project, monkeypatch, "-x", "-n", "0")
    assert [n for _, n in ran] == _derived()[:7]  # up to test_leaky, the first to fail
    serial.stdout.fnmatch_lines([FIRST_FAILURE, "*stopping after 1 failures*"])


def test_x_stops_at_the_first_failure_in_parallel_wide(
        project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    parallel, ran_n2 = _run(project, monkeypatch, *_nox_parallel_flags()[2:], "-n", "2", "-x",
                            subprocess=True)
    names = [n for _, n in ran_n2]
    # The controller stops handing out tests at the first failure (each worker has at
    # most two queued); tests of a few milliseconds may all have run by then.
    assert "tests/test_o.py::test_leaky" in names and len(set(names)) == len(names)
    parallel.stdout.fnmatch_lines([FIRST_FAILURE, "*stopping after 1 failures*"])


def test_the_command_line_overrides_the_lists(
        project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result, ran = _run(project, monkeypatch, "--kvh-order", "collection")
    assert [n for _, n in ran] == NODE_IDS
    assert "kvharness order" not in result.stdout.str()
    listed, ran = _run(project, monkeypatch, "--kvh-list-order")
    assert [n for _, n in ran] == NODE_IDS  # --kvh-list-order keeps the list's order
    assert "kvharness order" not in listed.stdout.str()


def test_without_a_kill_record_the_prior_orders(
        project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    (project.path / "lists" / ".test_kills.json").unlink()
    result, ran = _run(project, monkeypatch)
    # test_o.py binds KvCacheManager and no oracle: weight 1 for each test, so the cheap
    # ones go first.
    assert [n for _, n in ran] == fail_first(NODE_IDS, RUN_DURATIONS, None,
                                             dict.fromkeys(NODE_IDS, 1))
    assert [n for _, n in ran] != NODE_IDS
    result.stdout.fnmatch_lines(["*by the prior (no kill record)*"])


def test_an_unreadable_kill_record_stops_the_run(
        project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    (project.path / "bad.json").write_text('{"mutants": []}')
    result, ran = _run(project, monkeypatch, "--kvh-kill-record", "bad.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and ran == []
    result.stderr.fnmatch_lines(["*kvharness: --kvh-order: *bad.json: a kill record is*"])

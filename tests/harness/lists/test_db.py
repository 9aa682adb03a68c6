"""Test-db lists: the entry grammar, conditions, selection, and broken lists with their
messages and lines. A line ending in `#<-` is where the problem must be reported."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from harness.lists.db import load_test_db, load_test_list, resolve
from harness.lists.entry import covers, parse_entry_text
from harness.lists.errors import ListError
from harness.lists.hardware import Machine
from harness.lists.keywords import KeywordExpr

GOOD = """\
version: 0.0.1
l0_cpu:
- condition:
    ranges:
      system_gpu_count: {gte: 0, lte: 0}
    wildcards:
      gpu: ['*cpu*']
    terms:
      stage: pre_merge
  tests:
  - tests/unit
  - tests/harness/test_x.py::test_a TIMEOUT (5) ISOLATION
  - {test: 'tests/harness/test_x.py::test_b[p1]', timeout_seconds: 30}
- condition:
    ranges:
      system_gpu_count: {gte: 1}
    wildcards:
      gpu: ['*H100*', '*h200*']
    terms:
      stage: post_merge
      attention_backend: flashinfer
  tests:
  - tests/gpu
"""


def machine(stage: str = "pre_merge", gpu: str = "cpu", count: int = 0,
            backends: tuple[str, ...] = ("torch",)) -> Machine:
    return Machine.from_dict({"stage": stage, "gpu": gpu, "gpu_count": count,
                              "backends": list(backends), "cuda": count > 0,
                              "cpu_arch": "x86_64"})


def write_db(root: Path, files: dict[str, str]) -> Path:
    db = root / "test-db"
    db.mkdir()
    for name, text in files.items():
        (db / name).write_text(text)
    return db


def test_good_list_parses_into_blocks_and_entries(tmp_path: Path) -> None:
    db = load_test_db(write_db(tmp_path, {"l0_cpu.yml": GOOD}))
    first, second = db.blocks
    assert first.name == "l0_cpu[0]" and first.location.line == 3
    assert [e.test for e in first.entries] == [
        "tests/unit", "tests/harness/test_x.py::test_a", "tests/harness/test_x.py::test_b[p1]"]
    unit, a, b = first.entries
    assert (unit.timeout_seconds, unit.effective_timeout, unit.isolation) == (None, 3600, False)
    assert (a.timeout_seconds, a.isolation, a.location.line) == (300, True, 12)
    assert (b.timeout_seconds, b.isolation, b.location.line) == (30, False, 13)
    assert second.condition.term("attention_backend") == "flashinfer"
    [gpus] = second.condition.ranges
    assert (gpus.key, gpus.gte, gpus.lte) == ("system_gpu_count", 1, None)


@pytest.mark.parametrize(
    ("mach", "expected"),
    [
        pytest.param(machine(), ["tests/unit", "tests/harness/test_x.py::test_a",
                                 "tests/harness/test_x.py::test_b[p1]"], id="cpu-pre"),
        pytest.param(machine("post_merge"), [], id="cpu-post"),
        pytest.param(machine("post_merge", "NVIDIA H100 80GB HBM3", 8, ("torch", "flashinfer")),
                     ["tests/gpu"], id="h100-post"),
        pytest.param(machine("post_merge", "NVIDIA H100 80GB HBM3", 8), [], id="h100-no-fi"),
        pytest.param(machine("post_merge", "NVIDIA B200", 1, ("torch", "flashinfer")), [],
                     id="b200-post"),
        pytest.param(machine("pre_merge", "NVIDIA H200", 1, ("torch", "flashinfer")), [],
                     id="h200-pre"),
    ],
)
def test_selection_by_machine(tmp_path: Path, mach: Machine, expected: list[str]) -> None:
    db = load_test_db(write_db(tmp_path, {"l0_cpu.yml": GOOD}))
    assert [e.test for e in db.select(mach)] == expected


def test_explain_says_which_condition_failed(tmp_path: Path) -> None:
    db = load_test_db(write_db(tmp_path, {"l0_cpu.yml": GOOD}))
    verdicts = db.explain(machine("post_merge", "NVIDIA B200", 0, ("torch",)))
    failed = {c.key: c.detail for c in verdicts[1].checks if not c.passed}
    assert failed == {
        "attention_backend": "attention backend flashinfer is not among this run's backends "
                             "(torch)",
        "system_gpu_count": "gpu count 0 outside [1, inf]",
        "gpu": "gpu 'NVIDIA B200' matches none of ['*H100*', '*h200*']",
    }
    assert verdicts[0].checks[0].detail == "stage post_merge, block wants pre_merge"


@pytest.mark.parametrize(
    ("prefix", "node_id", "expected"),
    [
        ("tests/unit", "tests/unit/test_a.py::test_x", True),
        ("tests/unit", "tests/unit_more/test_a.py::test_x", False),
        ("tests/a.py", "tests/a.py::TestC::test_x", True),
        ("tests/a.py::TestC", "tests/a.py::TestC::test_x[p1]", True),
        ("tests/a.py::test_x", "tests/a.py::test_x[p1]", True),
        ("tests/a.py::test_x", "tests/a.py::test_xy", False),
        ("tests/a.py::test_x[p1]", "tests/a.py::test_x[p1]", True),
        ("tests/a.py::test_x[p1]", "tests/a.py::test_x[p10]", False),
    ],
)
def test_covers(prefix: str, node_id: str, expected: bool) -> None:
    assert covers(prefix, node_id) is expected


def test_resolve_prefers_the_most_specific_entry(tmp_path: Path) -> None:
    plain = tmp_path / "qa.txt"
    plain.write_text("# qa list\ntests/a.py\n\ntests/a.py::test_x TIMEOUT (2)\ntests/b.py\n")
    entries = load_test_list(plain)
    res = resolve(entries, ["tests/a.py::test_x[p1]", "tests/a.py::test_y"])
    assert res.chosen["tests/a.py::test_x[p1]"].timeout_seconds == 120
    assert res.chosen["tests/a.py::test_y"].test == "tests/a.py"
    assert [(e.test, e.location.line) for e in res.unmatched] == [("tests/b.py", 5)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tests/a.py", ("tests/a.py", None, False, None)),
        ("tests/a.py::t[x y] ISOLATION", ("tests/a.py::t[x y]", None, True, None)),
        ("tests/a.py  ISOLATION TIMEOUT ( 90 )", ("tests/a.py", 5400, True, None)),
        ("tests/a.py TIMEOUT(1)", ("tests/a.py", 60, False, None)),
        # TensorRT-LLM's spellings: comma-joined markers in either order, an explicit
        # default, and `-k` narrowing a path.
        ("tests/a.py::t TIMEOUT (90), ISOLATION", ("tests/a.py::t", 5400, True, None)),
        ("tests/a.py::t ISOLATION, TIMEOUT (90)", ("tests/a.py::t", 5400, True, None)),
        ("tests/a.py TIMEOUT (60)", ("tests/a.py", 3600, False, None)),
        ("tests/unit -k \"partition0\"", ("tests/unit", None, False, "partition0")),
        ("tests/unit -k 'not (slow or gpu)' TIMEOUT (5)", ("tests/unit", 300, False,
                                                           "not (slow or gpu)")),
        ("tests/unit -k manager ISOLATION", ("tests/unit", None, True, "manager")),
    ],
)
def test_entry_grammar(text: str, expected: tuple[str, int | None, bool, str | None]) -> None:
    spec = parse_entry_text(text)
    keyword = None if spec.keyword is None else spec.keyword.text
    assert (spec.test, spec.timeout_seconds, spec.isolation, keyword) == expected


@pytest.mark.parametrize(
    ("expr", "node_id", "expected"),
    [
        ("partition0", "tests/unit/test_attn.py::test_x[partition0-fp16]", True),
        ("partition0", "tests/unit/test_attn.py::test_x[partition1-fp16]", False),
        ("not slow", "tests/unit/test_slow_path.py::test_a", False),
        ("manager and not stateful", "tests/unit/test_manager_api.py::test_a", True),
        ("manager and not stateful", "tests/unit/test_manager_stateful.py::test_a", False),
        ("(eviction or reuse) and B4", "tests/s/test_reuse.py::test_a[copy-B4]", True),
        ("TestGroup", "tests/a.py::TestGroup::test_m", True),
        ("UNIT", "tests/unit/test_a.py::test_b", True),
    ],
)
def test_keyword_expressions_match_like_pytest_k(expr: str, node_id: str, expected: bool) -> None:
    assert KeywordExpr.parse(expr).matches(node_id) is expected


@pytest.mark.parametrize(("expr", "column"), [
    pytest.param("(" * 33 + "x" + ")" * 33, 33, id="parentheses"),
    pytest.param("not " * 33 + "x", 129, id="nots"),
    # parentheses and `not` count alike: the 17th `(` opens level 33
    pytest.param("(not " * 17 + "x" + ")" * 17, 81, id="mixed"),
    # 995 characters, within the 1,000 allowed: was a RecursionError
    pytest.param("(" * 497 + "x" + ")" * 497, 33, id="497-parentheses"),
])
def test_keyword_nesting_is_bounded(expr: str, column: int) -> None:
    with pytest.raises(ValueError) as info:
        KeywordExpr.parse(expr)
    assert str(info.value).endswith(": parentheses and 'not' nested more than 32 levels deep; "
                                    f"at most 32 are read (column {column})")


def test_keyword_nesting_up_to_the_bound_matches() -> None:
    deepest = KeywordExpr.parse("(" * 32 + "test_x" + ")" * 32)
    assert deepest.matches("tests/a.py::test_x") and not deepest.matches("tests/a.py::test_y")
    negated = KeywordExpr.parse("not " * 31 + "test_x")  # odd: one `not`
    assert negated.matches("tests/a.py::test_y") and not negated.matches("tests/a.py::test_x")


def test_both_forms_of_an_entry_are_one_entry_parsed_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A text entry and a mapping entry saying the same thing read as equal Entries (but
    for their lines), each `-k` parsed once: the schema's check is the parse the reader
    keeps (it parsed each twice, the mapping's through a second type)."""
    parsed: list[str] = []
    parse = KeywordExpr.parse.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(KeywordExpr, "parse",
                        classmethod(lambda cls, text, flag="-k": parsed.append(text)
                                    or parse(cls, text, flag)))
    db = load_test_db(write_db(tmp_path, {"l0_cpu.yml": _good(
        "  - tests/unit\n", "  - tests/unit -k 'not slow' TIMEOUT (5) ISOLATION\n"
        "  - {test: tests/unit, keyword: 'not slow', timeout_seconds: 300, isolation: true}\n")}))
    text, mapping = db.blocks[0].entries[:2]
    assert parsed == ["not slow", "not slow"]
    assert (text.location.line, mapping.location.line) == (11, 12)
    assert replace(text, location=mapping.location) == mapping
    assert mapping.covers("tests/unit/test_a.py::test_fast")
    assert not mapping.covers("tests/unit/test_slow.py::test_a")


def test_keyword_entries_select_part_of_a_prefix(tmp_path: Path) -> None:
    plain = tmp_path / "qa.txt"
    plain.write_text('tests/a.py -k "x and not p2"  # TensorRT-LLM style comment\n'
                     'tests/a.py -k test_y\n')
    entries = load_test_list(plain)
    res = resolve(entries, ["tests/a.py::test_x[p1]", "tests/a.py::test_x[p2]",
                            "tests/a.py::test_y", "tests/a.py::test_z"])
    assert {n: e.location.line for n, e in res.chosen.items()} == {
        "tests/a.py::test_x[p1]": 1, "tests/a.py::test_y": 2}


def _good(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


# (files, fragment of the message). The problem's line is the one marked `#<-`,
# or none when no line is marked.
BROKEN = {
    "yaml-syntax": ({"l0_cpu.yml": "version: 0.0.1\nl0_cpu: [a, b\n  c: d #<-\n"},
                    "YAML: "),
    "duplicate-key": ({"l0_cpu.yml": _good("  - tests/gpu\n", "  - tests/gpu\n  tests: #<-\n  - x\n")},
                      "duplicate key 'tests' (first at line 22)"),
    "not-a-mapping": ({"l0_cpu.yml": "- tests/unit #<-\n"},
                      "a list file is a mapping of 'version' and the context 'l0_cpu'"),
    "empty-file": ({"l0_cpu.yml": "# nothing\n"}, "a list file is a mapping"),
    "no-version": ({"l0_cpu.yml": GOOD.replace("version: 0.0.1\nl0_cpu:", "l0_cpu: #<-")},
                   "missing key 'version'"),
    "bad-version": ({"l0_cpu.yml": _good("version: 0.0.1", "version: 2.0 #<-")},
                    "version: Input should be '0.0.1' (got 2.0)"),
    "context-not-file-name": ({"l0_cpu.yml": GOOD + "l0_h100: #<-\n- {}\n"},
                              "unknown top-level key 'l0_h100': a list file holds 'version' and "
                              "one context named after the file ('l0_cpu')"),
    "bad-file-name": ({"L0-CPU.yml": GOOD}, "file name 'L0-CPU.yml': a list file is named after"),
    "unknown-block-key": ({"l0_cpu.yml": _good("  tests:\n  - tests/gpu", "  test: #<-\n  - tests/gpu")},
                          "l0_cpu[1]: unknown key 'test'; allowed: condition, tests"),
    "unknown-range-key": ({"l0_cpu.yml": _good("system_gpu_count: {gte: 1}",
                                               "system_gpu_count: {gt: 1} #<-")},
                          "unknown key 'gt'; allowed: gte, lte"),
    "empty-range": ({"l0_cpu.yml": _good("{gte: 1}", "{gte: 2, lte: 1} #<-")},
                    "empty range: gte 2 > lte 1"),
    "range-without-bounds": ({"l0_cpu.yml": _good("{gte: 1}", "{} #<-")},
                             "a range needs gte, lte or both"),
    "negative-range": ({"l0_cpu.yml": _good("{gte: 1}", "{gte: -1} #<-")},
                       "gte: Input should be greater than or equal to 0 (got -1)"),
    "bad-stage": ({"l0_cpu.yml": _good("stage: pre_merge", "stage: premerge #<-")},
                  "terms.stage: 'premerge' is not one of pre_merge, post_merge"),
    "bad-attention-backend": ({"l0_cpu.yml": _good("backend: flashinfer", "backend: cuda #<-")},
                              "terms.attention_backend: 'cuda' is not one of torch, flashinfer"),
    "attention-backend-as-backend": (
        {"l0_cpu.yml": _good("attention_backend: flashinfer", "backend: flashinfer #<-")},
        "terms.backend: 'flashinfer' is an attention backend; 'backend' is the job's "
        "(TensorRT-LLM's runtime: pytorch, cpp, tensorrt, triton, fmha, ...): write "
        "'attention_backend: flashinfer'"),
    "term-not-a-scalar": ({"l0_cpu.yml": _good("stage: post_merge", "stage: post_merge\n"
                                               "      auto_trigger: [others] #<-")},
                          "terms.auto_trigger: a term is one string, number or boolean "
                          "(got ['others'])"),
    "bad-feature-term": ({"l0_cpu.yml": _good("stage: post_merge", "stage: post_merge\n"
                                              "      supports_fp8: 'yes' #<-")},
                         "terms.supports_fp8: 'yes' is not one of true, false"),
    "empty-wildcard": ({"l0_cpu.yml": _good("gpu: ['*cpu*']", "gpu: [] #<-")},
                       "wildcards.gpu: Value should have at least 1 item"),
    "empty-tests": ({"l0_cpu.yml": _good("  tests:\n  - tests/gpu\n", "  tests: [] #<-\n")},
                    "l0_cpu[1].tests: List should have at least 1 item"),
    "bad-suffix": ({"l0_cpu.yml": _good("  - tests/unit\n", "  - tests/unit TIMEOUT 90 #<-\n")},
                   "unexpected 'TIMEOUT 90'; an entry is"),
    "timeout-over-a-day": ({"l0_cpu.yml": _good("  - tests/unit\n", "  - tests/unit TIMEOUT (1441) #<-\n")},
                           "TIMEOUT (1441) is not a whole number of minutes in 1..1440 (24 hours)"),
    "timeout-30-digits": ({"l0_cpu.yml": _good("  - tests/unit\n",
                                               f"  - tests/unit TIMEOUT ({'9' * 30}) #<-\n")},
                          "TIMEOUT (99999999999999999999... (30 characters)) is not a whole"),
    "timeout-mapping-over-a-day": ({"l0_cpu.yml": _good("timeout_seconds: 30}",
                                                        "timeout_seconds: 86401} #<-")},
                                   "timeout 86401 s is outside 1 s .. 86400 s (24 hours)"),
    "zero-timeout": ({"l0_cpu.yml": _good("TIMEOUT (5)", "TIMEOUT (0) #<-")},
                     "TIMEOUT (0) is not a whole number of minutes in 1..1440"),
    "text-after-skip": ({"l0_cpu.yml": _good("  - tests/unit\n",
                                             "  - tests/unit SKIP (x) ISOLATION #<-\n")},
                        "unexpected 'ISOLATION'; an entry is"),
    "bad-marker-expression": ({"l0_cpu.yml": _good("  - tests/unit\n",
                                                   "  - tests/unit -m 'gpu and' #<-\n")},
                              "-m 'gpu and': ends early; expected a name, 'not' or '('"),
    "bad-keyword": ({"l0_cpu.yml": _good("  - tests/unit\n", "  - tests/unit -k 'a and' #<-\n")},
                    "-k 'a and': ends early; expected a name, 'not' or '('"),
    "keyword-unclosed-quote": ({"l0_cpu.yml": _good("  - tests/unit\n",
                                                    "  - tests/unit -k \"a #<-\n")},
                               "-k: the quote \" is never closed"),
    "timeout-twice": ({"l0_cpu.yml": _good("TIMEOUT (5)", "TIMEOUT (5) TIMEOUT (6) #<-")},
                      "TIMEOUT given twice"),
    "mapping-unknown-key": ({"l0_cpu.yml": _good("timeout_seconds: 30}", "timout_seconds: 30} #<-")},
                            "unknown key 'timout_seconds'; allowed: test, timeout_seconds, "
                            "isolation, keyword"),
    "mapping-string-bool": ({"l0_cpu.yml": _good("timeout_seconds: 30}", "isolation: 'yes'} #<-")},
                            "isolation: Input should be a valid boolean (got 'yes')"),
    "entry-not-text": ({"l0_cpu.yml": _good("  - tests/unit\n", "  - 42 #<-\n")},
                       "an entry is a node id string or a mapping"),
    "absolute-node-id": ({"l0_cpu.yml": _good("  - tests/unit\n", "  - /srv/repo/tests/unit #<-\n")},
                         "paths are relative to the repository root"),
    "colons-after-folder": ({"l0_cpu.yml": _good("  - tests/unit\n", "  - tests/unit::test_x #<-\n")},
                            "'::' may only follow a .py file"),
    "dot-dot-path": ({"l0_cpu.yml": _good("  - tests/unit\n", "  - tests/../unit #<-\n")},
                     "has an empty, '.' or '..' part"),
    "unsafe-yaml-tag": ({"l0_cpu.yml": _good("  - tests/unit\n",
                                             "  - !!python/object/apply:os.system ['true'] #<-\n")},
                        "YAML: could not determine a constructor"),
    "no-yml-files": ({"README.md": "lists go here\n"}, "test-db folder holds no *.yml list"),
}


@pytest.mark.parametrize(("files", "fragment"), BROKEN.values(), ids=BROKEN.keys())
def test_broken_list_is_reported_with_file_and_line(
    tmp_path: Path, files: dict[str, str], fragment: str
) -> None:
    db = write_db(tmp_path, files)
    with pytest.raises(ListError) as caught:
        load_test_db(db)
    [name] = files
    marked = [i for i, line in enumerate(files[name].splitlines(), 1) if line.endswith("#<-")]
    hits = [p for p in caught.value.problems if fragment in p.message]
    assert hits, f"no problem says {fragment!r}:\n{caught.value}"
    problem = hits[0]
    assert problem.location.line == (marked[0] if marked else problem.location.line)
    if marked:
        assert str(problem).startswith(f"{db / name}:{marked[0]}: ")
    else:
        assert problem.location.file in (db, db / name)


def test_every_problem_of_every_file_is_reported(tmp_path: Path) -> None:
    db = write_db(tmp_path, {
        "l0_cpu.yml": _good("stage: pre_merge", "stage: x").replace("attention_backend: flashinfer",
                                                                    "attention_backend: y"),
        "l0_h100.yml": GOOD.replace("l0_cpu", "l0_h100").replace("version: 0.0.1", "version: 3"),
    })
    with pytest.raises(ListError) as caught:
        load_test_db(db)
    assert [(p.location.file.name, p.location.line) for p in caught.value.problems] == [
        ("l0_cpu.yml", 9), ("l0_cpu.yml", 21), ("l0_h100.yml", 1)]


@pytest.mark.parametrize(
    ("text", "fragment", "line"),
    [
        pytest.param("tests/a.py\ntests/a.py\n", "duplicate entry 'tests/a.py' (first at line 1)", 2,
                     id="duplicate"),
        pytest.param("tests/a.py EXTRA  # why\n", "unexpected 'EXTRA'", 1, id="unknown-marker"),
        pytest.param("# only a comment\n", "test list holds no entry", None, id="empty"),
        pytest.param("tests/a.py\ntests/b.py -k '" + "(" * 497 + "x" + ")" * 497 + "'\n",
                     "parentheses and 'not' nested more than 32 levels deep", 2, id="deep-keyword"),
        pytest.param("tests/a.py TIMEOUT (\uff15)\n", "TIMEOUT (\uff15): minutes are written in "
                     "ASCII digits 0-9", 1, id="fullwidth-timeout"),
    ],
)
def test_broken_plain_list(tmp_path: Path, text: str, fragment: str, line: int | None) -> None:
    path = tmp_path / "qa.txt"
    path.write_text(text)
    with pytest.raises(ListError) as caught:
        load_test_list(path)
    [problem] = caught.value.problems
    assert fragment in problem.message and problem.location == (path, line)

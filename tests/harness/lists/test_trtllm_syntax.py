"""The whole syntax of TensorRT-LLM's real test-db files, lists and waives (issue 24): any
term key matched against the job, its runtime `backend` as a job term beside this
harness's `attention_backend`, `-m` entries, SKIP/XFAIL/UNSTABLE in lists, `#` anywhere,
every error of a file at once, and `--context` reading only its own file. Each test names
the issue's bullet it holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.lists.db import load_test_db, load_test_list, resolve
from harness.lists.entry import Outcome, parse_entry_text
from harness.lists.errors import ListError
from harness.lists.hardware import Machine
from harness.lists.waives import load_waives

pytest_plugins = ["pytester"]

FIXTURES = Path(__file__).parent / "trtllm" / "fixtures"
REAL_LISTS = ("l0_a100", "l0_b200", "l0_dgx_h100", "l0_h100")


def machine(job: tuple[tuple[str, str], ...] = (), distribution: str = "ubuntu",
            gpu: str = "H100 PCIE", count: int = 1, stage: str = "pre_merge") -> Machine:
    return Machine(stage, gpu, count, ("torch", "flashinfer"), False, "x86_64", distribution,  # type: ignore[arg-type]
                   "9.0", "mpi", job=job)


def test_the_real_lists_and_waives_parse() -> None:
    """Issue bullets 1-3: every block, entry and waive line of TensorRT-LLM's files reads."""
    db = load_test_db(FIXTURES)
    assert [len([b for b in db.blocks if b.context == c]) for c in REAL_LISTS] == [3, 3, 6, 8]
    assert len(db.entries) == 540
    backends = {b.condition.term("backend") for b in db.blocks}
    assert backends == {"pytorch", "cpp", "tensorrt", "triton", "fmha"}
    assert {b.condition.term("auto_trigger") for b in db.blocks} == {None, "others", "deepseek"}
    marked = [e for e in db.entries if e.marker is not None]
    assert len(marked) == 14 and marked[0].text == 'unittest/llmapi/test_llm_pytorch.py -m "part0"'
    read = load_waives(FIXTURES / "waives.txt")
    assert (len(read.waives), read.problems) == (455, ())
    assert sum(w.gpu == "sm100" for w in read.waives) == 14
    [several] = [w for w in read.waives if w.more]
    assert len(several.more) == 9  # ten ids on one line: one waive


def test_backend_is_the_jobs_term() -> None:
    """Issue bullets 1 and 6: `backend: cpp` is a job term compared for equality, not an
    attention backend; with no job backend the block does not apply to this machine."""
    db = load_test_db(FIXTURES, "l0_h100")
    chosen = {v.block.index for v in db.explain(machine((("backend", "cpp"),
                                                          ("auto_trigger", "others"))))
              if v.selected}
    assert chosen == {2}
    verdict = db.explain(machine())[2]
    assert ("backend", False, "the machine has no 'backend' (a job term: --job backend=VALUE)") \
        in verdict.checks


def test_the_distribution_override_satisfies_ubuntu() -> None:
    """Issue bullet 4: `linux_distribution_name: ubuntu*` holds when the distribution
    says ubuntu (the override), not on debian."""
    db = load_test_db(FIXTURES, "l0_h100")
    job = (("backend", "pytorch"),)
    assert len(db.select(machine(job, "ubuntu"))) == 92
    assert db.select(machine(job, "debian")) == ()


def test_context_reads_only_its_own_file(tmp_path: Path) -> None:
    """Issue bullet 5: errors in other files do not stop `--context`."""
    db_dir = tmp_path / "test-db"
    db_dir.mkdir()
    (db_dir / "l0_h100.yml").write_text((FIXTURES / "l0_h100.yml").read_text())
    (db_dir / "l0_a100.yml").write_text("version: 0.0.1\nl0_a100: [broken\n")
    assert len(load_test_db(db_dir, "l0_h100").blocks) == 8
    with pytest.raises(ListError, match="YAML"):
        load_test_db(db_dir)
    with pytest.raises(ListError, match="no context 'l0_b200'; this test-db holds l0_a100, l0_h100"):
        load_test_db(db_dir, "l0_b200")


BROKEN_BLOCK = """\
version: 0.0.1
l0_h100:
- condition:
    terms:
      stage: premerge
      orchestrator: slurm
    wildcard:
      gpu: ['*h100*']
  tests:
  - unittest/a.py -m "part0" TIMEOUT (x)
  - {test: unittest/b.py, timout: 5, isolation: 'yes'}
  flaky: true
"""


def test_every_error_of_a_block_is_reported_at_once(tmp_path: Path) -> None:
    """Issue bullet 2: an unknown key no longer hides its block's other errors, and every
    value message names the allowed values the same way."""
    (tmp_path / "l0_h100.yml").write_text(BROKEN_BLOCK)
    with pytest.raises(ListError) as caught:
        load_test_db(tmp_path)
    found = [(p.location.line, p.message) for p in caught.value.problems]
    assert found == [
        (5, "l0_h100[0].condition.terms.stage: 'premerge' is not one of pre_merge, post_merge"),
        (6, "l0_h100[0].condition.terms.orchestrator: 'slurm' is not one of mpi, ray"),
        (7, "l0_h100[0].condition: unknown key 'wildcard'; allowed: ranges, wildcards, terms"),
        (10, "l0_h100[0].tests[0]: entry 'unittest/a.py -m \"part0\" TIMEOUT (x)': TIMEOUT (x) "
             "is not a whole number of minutes in 1..1440 (24 hours)"),
        (11, "l0_h100[0].tests[1]: unknown key 'timout'; allowed: test, timeout_seconds, "
             "isolation, keyword, marker"),
        (11, "l0_h100[0].tests[1].isolation: Input should be a valid boolean (got 'yes')"),
        (12, "l0_h100[0]: unknown key 'flaky'; allowed: condition, tests, reruns, always_run, "
             "source_file_dependencies, order"),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('unittest/x.py -m "not (gpu2 or gpu4)"', ("unittest/x.py", None, "not (gpu2 or gpu4)", None)),
        ('unittest/_torch -k "eagle3" -m "part0" TIMEOUT (90)',
         ("unittest/_torch", "eagle3", "part0", None)),
        ("tests/a.py::t SKIP (https://nvbugs/1)", ("tests/a.py::t", None, None,
                                                   Outcome("SKIP", "https://nvbugs/1"))),
        ("tests/a.py::t XFAIL", ("tests/a.py::t", None, None, Outcome("XFAIL", None))),
        ("tests/a.py TIMEOUT (5) UNSTABLE (flaky (x))",
         ("tests/a.py", None, None, Outcome("UNSTABLE", "flaky (x)"))),
    ],
)
def test_entry_markers_and_outcomes(text: str, expected: tuple[object, ...]) -> None:
    entry = parse_entry_text(text)
    keyword = None if entry.keyword is None else entry.keyword.text
    marker = None if entry.marker is None else entry.marker.text
    assert (entry.test, keyword, marker, entry.outcome) == expected


def test_marker_entries_select_by_markers(tmp_path: Path) -> None:
    plain = tmp_path / "qa.txt"
    plain.write_text('tests/a.py -m "part0 and not gpu2"\n')
    [entry] = load_test_list(plain)
    marks = {"tests/a.py::t1": ["part0"], "tests/a.py::t2": ["part0", "gpu2"],
             "tests/a.py::t3": []}
    assert sorted(resolve([entry], marks, marks).chosen) == ["tests/a.py::t1"]
    # Markers unknown (ids alone, as `validate` collects them): the whole prefix.
    assert sorted(resolve([entry], marks).chosen) == sorted(marks)


def test_a_hash_anywhere_starts_a_comment(tmp_path: Path) -> None:
    plain = tmp_path / "qa.txt"
    plain.write_text("tests/a.py::t[x]#no space before it\n")
    [entry] = load_test_list(plain)
    assert entry.test == "tests/a.py::t[x]"


TESTS = """\
import pytest

@pytest.mark.part0
def test_a(): pass

def test_b(): pass

def test_c(): assert False

def test_d(): assert False
"""

LIST = """\
version: 0.0.1
l0_h100:
- condition:
    wildcards:
      gpu: ['*h100*']
      linux_distribution_name: ubuntu*
    terms:
      stage: pre_merge
      backend: pytorch
      auto_trigger: others
  tests:
  - tests/test_t.py -m "part0"
  - tests/test_t.py::test_b SKIP (https://nvbugs/1)
  - tests/test_t.py::test_c XFAIL (known)
  - tests/test_t.py::test_d UNSTABLE
"""


def test_a_plugin_run_of_a_tensorrt_llm_style_block(quiet_pytester: pytest.Pytester) -> None:
    """A block of job terms runs when the job says them (`--kvh-job`) on a machine that
    claims ubuntu (`--kvh-distribution`); `-m` selects by marker; SKIP, XFAIL and
    UNSTABLE in the list mark their tests."""
    quiet_pytester.mkdir("tests")
    quiet_pytester.path.joinpath("tests", "test_t.py").write_text(TESTS)
    quiet_pytester.path.joinpath("pytest.ini").write_text("[pytest]\nmarkers =\n    part0: x\n")
    db = quiet_pytester.mkdir("test-db")
    db.joinpath("l0_h100.yml").write_text(LIST)
    flags = ["--kvh-test-db", "test-db", "--kvh-context", "l0_h100", "--kvh-gpu", "NVIDIA H100"]
    job = ["--kvh-job", "backend=pytorch", "--kvh-job", "auto_trigger=others"]
    result = quiet_pytester.runpytest(*flags, *job, "--kvh-distribution", "ubuntu", "-rsx")
    result.assert_outcomes(passed=1, skipped=1, xfailed=2)
    result.stdout.fnmatch_lines(["*listed SKIP: https://nvbugs/1*", "*listed XFAIL: known*"])
    debian = quiet_pytester.runpytest(*flags, *job, "--kvh-distribution", "debian")
    assert debian.ret == pytest.ExitCode.USAGE_ERROR
    debian.stderr.fnmatch_lines(["*no block of context l0_h100 of test-db applies to*"])


FOREIGN_LIST = """\
accuracy/test_llm_api_pytorch.py::TestLlama3_1_8B::test_nvfp4
unittest/_torch/attention -k "not fp8"
tests/test_t.py::test_a
"""


@pytest.mark.parametrize(("how", "scoped"), [
    # 388 waives hold everywhere; full:H100_PCIe/ holds under its stage's prefix too.
    (["--test-prefix", "H100_PCIe-PyTorch-1"], 389), (["--kvh-foreign-lists"], 388)],
    ids=["test-prefix", "flag"])
def test_foreign_ids_are_counted_in_one_line(quiet_pytester: pytest.Pytester,
                                             how: list[str], scoped: int) -> None:
    """Issue bullet 3's last part: TensorRT-LLM's waives (and list entries) that match
    nothing here are one count in the summary line, not a warning each, not an error."""
    quiet_pytester.mkdir("tests")
    quiet_pytester.path.joinpath("tests", "test_t.py").write_text(TESTS)
    quiet_pytester.path.joinpath("pytest.ini").write_text("[pytest]\nmarkers =\n    part0: x\n")
    quiet_pytester.path.joinpath("l0_h100.txt").write_text(FOREIGN_LIST)
    result = quiet_pytester.runpytest("--test-list", "l0_h100.txt", "--waives-file",
                                      str(FIXTURES / "waives.txt"), *how)
    result.assert_outcomes(passed=1, deselected=3)
    assert not [line for line in result.stdout.lines + result.stderr.lines
                if "kvharness warning" in line]
    result.stdout.fnmatch_lines([f"kvharness: 1 selected, 3 deselected, 2 entries matching "
                                 f"nothing, 0 waived, {scoped} waives matching nothing, "
                                 "0 isolated"])


def test_this_repositorys_lists_stay_strict(quiet_pytester: pytest.Pytester) -> None:
    quiet_pytester.mkdir("tests")
    quiet_pytester.path.joinpath("tests", "test_t.py").write_text(TESTS)
    quiet_pytester.path.joinpath("l0_h100.txt").write_text(FOREIGN_LIST)
    result = quiet_pytester.runpytest("--test-list", "l0_h100.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*list entries select no collected test:*",
                                 "*entry 'accuracy/test_llm_api_pytorch.py::*: no such file*"])


@pytest.mark.parametrize("refusal", [
    pytest.param(("version: 0.0.1\nx: &a [1]\nl0_h100: *a\n", 3, "YAML: aliases (*a) are not "
                  "allowed in list files; write the value out"), id="alias"),
    pytest.param(("version: 0.0.1\nl0_h100: " + "[" * 40 + "]" * 40 + "\n", 2, "YAML: "
                  "sequences and mappings nested more than 32 levels deep; at most 32 are read"),
                 id="deep"),
    pytest.param(("version: 0.0.1\nversion: 0.0.1\n", 2, "YAML: duplicate key 'version' "
                  "(first at line 1)"), id="duplicate-key"),
])
def test_libyaml_and_the_python_loader_read_alike(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: tuple[str, int, str]) -> None:
    """Lists are composed by libyaml when PyYAML has it (the fixtures in a tenth of the
    time) and by the pure-Python ListLoader otherwise: the same blocks, the same refusals
    at the same lines."""
    from harness.lists import schema

    text, line, message = refusal
    (tmp_path / "l0_h100.yml").write_text(text)
    results = []
    for loader in (schema._CListLoader, None):
        monkeypatch.setattr(schema, "_CListLoader", loader)
        db = load_test_db(FIXTURES)
        with pytest.raises(ListError) as caught:
            load_test_db(tmp_path)
        [problem] = caught.value.problems
        results.append(([(b.name, b.condition, [e.line for e in b.entries]) for b in db.blocks],
                        problem.location.line, problem.message))
    assert results[0] == results[1]
    assert results[0][1:] == (line, message)


def test_list_selects_a_real_block_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue bullet 4: with a pretended distribution and the job's terms, `kvharness list`
    selects TensorRT-LLM's H100 pre-merge PyTorch block on any runner, Debian included."""
    from harness.cli import main

    flags = ["list", "--test-db", str(FIXTURES), "--context", "l0_h100", "--gpu",
             "NVIDIA H100 PCIe", "--gpu-count", "1", "--job", "backend=pytorch",
             "--job", "auto_trigger=others"]
    assert main([*flags, "--distribution", "ubuntu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 92 and out[0].startswith("unittest/_torch/attention  [")
    main([*flags, "--distribution", "debian", "--explain"])  # no block: its exit code is list's
    explained = capsys.readouterr().out
    assert "[no] linux_distribution_name 'debian' matches none of ['ubuntu*']" in explained


def test_the_job_reaches_xdist_workers() -> None:
    """The controller hands workers the machine as a dict: the job terms travel with it."""
    mach = machine((("backend", "cpp"), ("auto_trigger", "others")), "ubuntu")
    assert Machine.from_dict(mach.as_dict()) == mach


@pytest.mark.parametrize(
    ("description", "exact", "expected"),
    [
        pytest.param({"system_gpu_count": "4", "gpu": "DGX_H100", "supports_fp8": True,
                      "backend": "cpp"}, True, True, id="numbers-as-text"),
        pytest.param({"system_gpu_count": 4.0, "gpu": "NVIDIA H100 80GB HBM3",
                      "supports_fp8": "True", "backend": "cpp"}, True, True, id="typed"),
        pytest.param({"system_gpu_count": "5", "gpu": "H100", "supports_fp8": True,
                      "backend": "cpp"}, True, False, id="outside-range"),
        pytest.param({"system_gpu_count": "4", "gpu": "GB200", "supports_fp8": True,
                      "backend": "cpp"}, True, False, id="no-glob-matches"),
        pytest.param({"system_gpu_count": "4", "gpu": "H100", "supports_fp8": False,
                      "backend": "cpp"}, True, False, id="bool-term"),
        pytest.param({"system_gpu_count": "4", "gpu": "H100", "supports_fp8": True,
                      "backend": None}, False, True, id="null-ignored-by-match"),
        pytest.param({"system_gpu_count": "4", "gpu": "H100", "supports_fp8": True,
                      "backend": None}, True, False, id="null-fails-match-exact"),
        pytest.param({"system_gpu_count": "four", "gpu": "H100", "supports_fp8": True,
                      "backend": "cpp"}, False, False, id="not-a-number"),
    ],
)
def test_a_condition_against_a_description(tmp_path: Path, description: dict[str, object],
                                           exact: bool, expected: bool) -> None:
    """trt-test-db's reading of a condition: inclusive ranges over numbers or their text,
    case-insensitive globs (a list: any), terms equal (true and "True" alike), null as
    absent (ignored by --match, failing under --match-exact)."""
    (tmp_path / "l0_x.yml").write_text(
        "version: 0.0.1\nl0_x:\n- condition:\n    ranges:\n      system_gpu_count: {gte: 4, lte: 4}"
        "\n    wildcards:\n      gpu: ['*h100*', '*h200*']\n    terms:\n      supports_fp8: true"
        "\n      backend: cpp\n  tests:\n  - a.py\n")
    [verdict] = load_test_db(tmp_path).explain(description, exact)
    assert verdict.selected is expected


def test_a_plugin_run_on_the_real_test_db(quiet_pytester: pytest.Pytester) -> None:
    """TensorRT-LLM's own l0_h100 and waives.txt in a pytest run here, as its H100_PCIe
    pre-merge PyTorch stage: the block applies, its 92 entries and the waives match no test
    of this project, and that is one summary line, no warning, no error."""
    quiet_pytester.mkdir("tests")
    quiet_pytester.path.joinpath("tests", "test_t.py").write_text("def test_here(): pass\n")
    result = quiet_pytester.runpytest(
        "--kvh-test-db", str(FIXTURES), "--kvh-context", "l0_h100", "--waives-file",
        str(FIXTURES / "waives.txt"), "--kvh-gpu", "NVIDIA H100 PCIe", "--kvh-gpu-count", "1",
        "--kvh-distribution", "ubuntu", "--kvh-job", "backend=pytorch", "--kvh-job",
        "auto_trigger=others", "--kvh-foreign-lists", "--rootdir", str(quiet_pytester.path))
    assert not [line for line in result.stdout.lines if "kvharness warning" in line]
    # 388 waives hold everywhere; without a prefix full:H100/ and full:H100_PCIe/ hold on
    # "NVIDIA H100 PCIe" too (this harness's rule: a whole word of the GPU name).
    result.stdout.fnmatch_lines([
        "kvharness lists: 92 entries from * (l0_h100); 390 waives from *waives.txt",
        "kvharness: 0 selected, 1 deselected, 92 entries matching nothing, 0 waived, "
        "390 waives matching nothing, 0 isolated"])

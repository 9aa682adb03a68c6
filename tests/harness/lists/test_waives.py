"""waives.txt in TensorRT-LLM's syntax: `SKIP (https://nvbugs/...)`, bare `SKIP`, reasons
without links, `full:<GPU>/` scopes, `# comments`; a bad line is reported with its file
and line while the other waives still apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.lists.errors import ListError
from harness.lists.waives import load_waives, waive_for

# Lines as TensorRT-LLM's waives.txt writes them (ids made local).
WAIVES = """\
# known failures
tests/a.py::t[p1] SKIP (https://nvbugs/5100001)
full:B200/tests/a.py::t[p2] SKIP (https://nvbugs/5100002)
full:H100_PCIe/tests/b.py SKIP (fails on PCIe) https://github.com/o/r/issues/3
tests/c.py::test_x SKIP
tests/c.py::test_y SKIP (flaky copy (issue) on B200)  # owner: kv team
tests/d.py SKIP # (https://nvbugs/5100004): a `#` anywhere starts a comment
"""


@pytest.fixture
def waives_file(tmp_path: Path) -> Path:
    path = tmp_path / "waives.txt"
    path.write_text(WAIVES)
    return path


def test_tensorrt_llm_lines_parse(waives_file: Path) -> None:
    read = load_waives(waives_file)
    assert read.problems == ()
    assert [(w.text, w.reason, w.link, w.location.line) for w in read.waives] == [
        ("tests/a.py::t[p1]", "https://nvbugs/5100001", "https://nvbugs/5100001", 2),
        ("full:B200/tests/a.py::t[p2]", "https://nvbugs/5100002", "https://nvbugs/5100002", 3),
        ("full:H100_PCIe/tests/b.py", "fails on PCIe", "https://github.com/o/r/issues/3", 4),
        ("tests/c.py::test_x", None, None, 5),
        ("tests/c.py::test_y", "flaky copy (issue) on B200", None, 6),
        ("tests/d.py", None, None, 7),
    ]
    reasons = {w.test: w.skip_reason for w in read.waives}
    assert reasons["tests/a.py::t[p1]"] == "waived: https://nvbugs/5100001"
    assert reasons["tests/b.py"] == "waived: fails on PCIe (https://github.com/o/r/issues/3)"
    assert reasons["tests/c.py::test_x"] == "waived (no reason given)"
    assert [p.location.line for p in read.without_link()] == [5, 6, 7]


@pytest.mark.parametrize(
    ("gpu", "prefix", "expected"),
    [
        pytest.param("cpu", None, ["tests/a.py::t[p1]", "tests/c.py::test_x"], id="cpu"),
        pytest.param("NVIDIA B200", None,
                     ["tests/a.py::t[p1]", "tests/a.py::t[p2]", "tests/c.py::test_x"], id="b200"),
        pytest.param("NVIDIA GB200", None, ["tests/a.py::t[p1]", "tests/c.py::test_x"],
                     id="gb200-is-not-b200"),
        pytest.param("NVIDIA H100 PCIe", None,
                     ["tests/a.py::t[p1]", "tests/b.py", "tests/c.py::test_x"], id="h100-pcie"),
        pytest.param("NVIDIA H100 80GB HBM3", None, ["tests/a.py::t[p1]", "tests/c.py::test_x"],
                     id="h100-sxm"),
        # TensorRT-LLM's rule: the test prefix's first '-' part names the GPU kind.
        pytest.param("cpu", "B200-PyTorch-1",
                     ["tests/a.py::t[p1]", "tests/a.py::t[p2]", "tests/c.py::test_x"],
                     id="prefix-b200"),
        pytest.param("NVIDIA B200", "H100-PyTorch-1", ["tests/a.py::t[p1]", "tests/c.py::test_x"],
                     id="prefix-wins"),
    ],
)
def test_full_prefix_scopes_a_waive_to_one_gpu_kind(
    waives_file: Path, gpu: str, prefix: str | None, expected: list[str]
) -> None:
    here = load_waives(waives_file).on(gpu, prefix)
    node_ids = ["tests/a.py::t[p1]", "tests/a.py::t[p2]", "tests/b.py::test_q",
                "tests/c.py::test_x"]
    hits = {n: waive_for(here, n) for n in node_ids}
    assert sorted(w.test for w in hits.values() if w is not None) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("tests/a.py skip (x)\n", "is not '[full:<GPU>/]<node id> [-k", id="lower-case"),
        pytest.param("tests/a.py XFAIL (x)\n", "only SKIP is a waive here (XFAIL is not)",
                     id="xfail"),
        pytest.param("tests/a.py SKIP (x\n", "'(' of the reason is never closed", id="unclosed"),
        pytest.param("tests/a.py SKIP (x) nvbugs/123\n", "unexpected 'nvbugs/123' after SKIP",
                     id="bad-link"),
        pytest.param("/abs/a.py SKIP (x)\n", "relative to the repository root", id="absolute"),
        pytest.param("tests/a.py\n", "is not '[full:<GPU>/]<node id> [-k", id="no-marker"),
        # TensorRT-LLM cuts a line at its first `#`, inside a link too.
        pytest.param("tests/a.py SKIP (https://github.com/o/r/issues/7#issuecomment-1)\n",
                     "'(' of the reason is never closed", id="hash-in-a-link"),
        pytest.param("tests/a.py -m 'gpu and' SKIP\n", "-m 'gpu and': ends early", id="bad-m"),
        pytest.param("tests/a.py -k x -k y SKIP\n", "-k given twice", id="k-twice"),
        pytest.param("tests/a.py SKIP\ntests/a.py SKIP (y)\n",
                     "'tests/a.py' is waived twice (first at line 2)", id="twice"),
    ],
)
def test_a_bad_line_is_a_problem_and_the_rest_apply(tmp_path: Path, text: str,
                                                    fragment: str) -> None:
    path = tmp_path / "waives.txt"
    path.write_text("tests/ok.py SKIP (https://nvbugs/1)\n" + text)
    read = load_waives(path)
    [problem] = read.problems
    assert fragment in problem.message and problem.message.endswith("(line ignored)")
    assert problem.location == (path, len(text.splitlines()) + 1)
    assert read.waives[0].test == "tests/ok.py"


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        pytest.param(lambda p: p.mkdir(), "waives file is a directory", id="directory"),
        pytest.param(lambda p: p.write_bytes(b"tests/a.py SKIP (\xff)\n"),
                     "waives file is not UTF-8 text: byte 0xff at offset 17", id="not-utf8"),
        pytest.param(lambda p: None, "waives file does not exist", id="missing"),
    ],
)
def test_an_unreadable_file_is_a_list_error_naming_it(tmp_path: Path, make: object,
                                                      fragment: str) -> None:
    path = tmp_path / "waives.txt"
    make(path)  # type: ignore[operator]
    with pytest.raises(ListError) as caught:
        load_waives(path)
    assert str(caught.value).startswith(str(path)) and fragment in str(caught.value)


# TensorRT-LLM's waives.txt forms (lines 237, 293, 297, 299 of its 455-line file, ids made
# local): a folder with its trailing slash, `-m` and `-k` waives, and a line of several ids.
TRTLLM_FORMS = """\
full:A10/tests/kv/ SKIP (https://nvbugs/5841954)
full:sm100/tests/m.py -m "not (part0 or part1)" SKIP (Disable for Blackwell OOM)
full:sm100/tests/a.py tests/b.py tests/others SKIP (Disable for Blackwell)
tests/k.py -k "partition0" SKIP (https://nvbugs/1)
"""


def test_a_waive_covers_its_own_tests_and_no_longer_id(waives_file: Path) -> None:
    """A waive selects as a list entry does: the id, its parameters, what is below it;
    never a test whose id merely starts with its text (the waive of t[p1] skipping t[p10],
    test_x's skipping test_xy: tests nobody waived)."""
    waives = load_waives(waives_file).waives

    def waived_by(node_id: str) -> str | None:
        waive = waive_for(waives, node_id)
        return None if waive is None else waive.test

    assert waived_by("tests/a.py::t[p1]") == "tests/a.py::t[p1]"
    assert waived_by("tests/c.py::test_x[B4]") == "tests/c.py::test_x"
    assert waived_by("tests/d.py::TestT::test_u") == "tests/d.py"
    for other in ("tests/a.py::t[p10]", "tests/c.py::test_xy", "tests/c.py::test_x_wide",
                  "tests/d.pyi::test_u"):
        assert waived_by(other) is None, other


def test_tensorrt_llm_forms_parse_as_its_parser_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "waives.txt"
    path.write_text(TRTLLM_FORMS)
    read = load_waives(path)
    assert read.problems == ()
    folder, marker, several, keyword = read.waives
    assert (folder.gpu, folder.test) == ("A10", "tests/kv/")
    assert folder.covers("tests/kv/test_x.py::test_y") and not folder.covers("tests/kvx/a.py")
    assert marker.text == 'full:sm100/tests/m.py -m "not (part0 or part1)"'
    assert marker.covers("tests/m.py::test_a", marks=["gpu2"])
    assert not marker.covers("tests/m.py::test_a", marks=["part1"])
    # One waive of the entry written the same way, not three waives (TensorRT-LLM's reading).
    assert (several.test, several.more) == ("tests/a.py", ("tests/b.py", "tests/others"))
    assert not several.covers("tests/a.py::test_x")
    assert several.waives_entry("tests/a.py tests/b.py tests/others")
    assert keyword.covers("tests/k.py::test_x[partition0]")
    assert not keyword.covers("tests/k.py::test_x[partition1]")
    assert waive_for((keyword,), "tests/k.py::test_z", entry_text='tests/k.py -k "partition0"') \
        is keyword


@pytest.mark.parametrize(
    ("gpu", "capability", "prefix", "expected"),
    [
        # This harness's extension without a prefix: smNNN is compute capability N.N.
        pytest.param("NVIDIA B200", "10.0", None, True, id="b200-sm100"),
        pytest.param("NVIDIA B300", "10.3", None, False, id="b300-is-not-sm100"),
        pytest.param("NVIDIA H100", "9.0", None, False, id="h100"),
        pytest.param("cpu", None, None, False, id="cpu"),
        # TensorRT-LLM's rule with a prefix, and only it: no stage is named sm100-...
        pytest.param("NVIDIA B200", "10.0", "B200_PCIe-PyTorch-1", False, id="ci-stage"),
        pytest.param("NVIDIA B200", "10.0", "sm100-x", True, id="prefix-sm100"),
    ],
)
def test_full_sm_scopes_by_compute_capability(tmp_path: Path, gpu: str, capability: str | None,
                                              prefix: str | None, expected: bool) -> None:
    path = tmp_path / "waives.txt"
    path.write_text(TRTLLM_FORMS)
    waive = load_waives(path).waives[1]
    assert waive.applies_on(gpu, prefix, capability) is expected


def test_full_prefix_is_case_sensitive_as_in_tensorrt_llm(waives_file: Path) -> None:
    scoped = load_waives(waives_file).waives[2]  # full:H100_PCIe/
    assert scoped.applies_on("cpu", "H100_PCIe-PyTorch-1")
    assert not scoped.applies_on("cpu", "h100_pcie-PyTorch-1")


def test_foreign_lists_waive_exact_ids_only(tmp_path: Path) -> None:
    """TensorRT-LLM matches waives to exact node ids (or to the entry written the same):
    with its lists a folder waive must not skip a test by prefix (REPORT ambiguity 2)."""
    path = tmp_path / "waives.txt"
    path.write_text("full:sm100/unittest/trt/functional SKIP (Disable for Blackwell)\n"
                    "unittest/a.py::test_x SKIP (https://nvbugs/1)\n")
    here = load_waives(path).on("NVIDIA B200", None, "10.0")
    fp4 = "unittest/trt/functional/test_fp4_gemm.py::test_fp4"
    assert waive_for(here, fp4) is not None  # this harness's prefix rule
    assert waive_for(here, fp4, exact=True) is None
    assert waive_for(here, "unittest/a.py::test_x", exact=True) is here[1]
    assert waive_for(here, "unittest/a.py::test_x[p]", exact=True) is None
    assert waive_for(here, fp4, entry_text="unittest/trt/functional", exact=True) is here[0]

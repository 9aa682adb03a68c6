"""Lists and waives written as TensorRT-LLM writes them select as TensorRT-LLM would:
its condition keys, `-k` entries, comma-joined markers, `full:<GPU>/` waives,
`--kvh-context`, `--test-list` with `--waives-file` and `--test-prefix`, `--kvh-list-order`;
pretending to be a GPU machine; orphans and misspelled keys."""

from __future__ import annotations

import platform
import xml.etree.ElementTree as ET

import pytest

pytest_plugins = ["pytester"]

TESTS = """\
import pytest

@pytest.mark.parametrize("part", ["partition0", "partition1", "partition2"])
def test_attention(part): pass

def test_fp8_gemm(): pass
def test_cache(): pass

@pytest.mark.gpu
def test_kernel(): pass
"""

DISTRO = platform.freedesktop_os_release().get("ID", "linux")
ARCH = platform.machine()

# l0_h100 as TensorRT-LLM writes it: two blocks by backend, fp8 and distribution terms.
L0_H100 = f"""\
version: 0.0.1
l0_h100:
- condition:
    ranges:
      system_gpu_count:
        gte: 1
        lte: 1
    wildcards:
      gpu:
      - '*h100*'
      linux_distribution_name: {DISTRO}*
      cpu: {ARCH}
    terms:
      stage: pre_merge
      backend: pytorch
      orchestrator: mpi
  tests:
  # ------------- PyTorch tests ---------------
  - tests/test_k.py -k "partition0 or partition2"
  - tests/test_k.py::test_cache TIMEOUT (90), ISOLATION # 1 min
- condition:
    ranges:
      system_gpu_count:
        gte: 1
    wildcards:
      gpu:
      - '*h100*'
    terms:
      stage: pre_merge
      attention_backend: flashinfer
      supports_fp8: true
  tests:
  - tests/test_k.py::test_fp8_gemm
  - tests/test_k.py::test_kernel
- condition:
    wildcards:
      gpu:
      - '*h100*'
      linux_distribution_name: nosuchdistro*
    terms:
      stage: pre_merge
  tests:
  - tests/test_k.py::test_attention[partition1]
"""

L0_CPU = """\
version: 0.0.1
l0_cpu:
- condition:
    ranges:
      system_gpu_count: {gte: 0, lte: 0}
    terms:
      stage: pre_merge
  tests:
  - tests/test_k.py::test_cache
"""

WAIVES = """\
full:H100/tests/test_k.py::test_attention[partition2] SKIP (https://nvbugs/5000001)
full:B200/tests/test_k.py::test_fp8_gemm SKIP (https://nvbugs/5000002)
tests/test_k.py::test_kernel SKIP  # no link yet
"""


@pytest.fixture
def project(quiet_pytester: pytest.Pytester) -> pytest.Pytester:
    pytester = quiet_pytester
    pytester.mkdir("tests")
    pytester.path.joinpath("tests", "test_k.py").write_text(TESTS)
    db = pytester.mkdir("lists").joinpath("test-db")
    db.mkdir()
    db.joinpath("l0_h100.yml").write_text(L0_H100)
    db.joinpath("l0_cpu.yml").write_text(L0_CPU)
    pytester.path.joinpath("lists", "waives.txt").write_text(WAIVES)
    return pytester


def _outcomes(result: pytest.RunResult) -> dict[str, str]:
    reports = result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for r in reports:
        if r.when == "call" or (r.when == "setup" and r.skipped):
            out[r.nodeid.split("::", 1)[1]] = r.outcome
    return out


def test_a_pretended_h100_selects_the_h100_blocks(project: pytest.Pytester) -> None:
    result = project.runpytest("--kvh-test-db", "lists/test-db", "--kvh-gpu", "NVIDIA H100",
                               "--kvh-gpu-count", "1", "--kvh-job", "backend=pytorch", "-rs")
    assert _outcomes(result) == {
        "test_attention[partition0]": "passed",
        "test_attention[partition2]": "skipped",  # full:H100 waive
        "test_cache": "passed",  # ISOLATION: its own process
        "test_fp8_gemm": "passed",  # supports_fp8 from the pretended H100's SM 9.0
        "test_kernel": "skipped",  # waived everywhere (and no CUDA here)
    }
    result.stdout.fnmatch_lines([
        "kvharness machine: stage=pre_merge gpu='NVIDIA H100' (pretended) gpu_count=1 cc=9.0 "
        "backends=torch,flashinfer cuda=no backend=pytorch",
        "kvharness: 5 selected, 1 deselected, 2 waived, 1 isolated, 0 in no list",
        "*waived: https://nvbugs/5000001",
    ])


def test_context_selects_one_file(project: pytest.Pytester) -> None:
    result = project.runpytest("--kvh-test-db", "lists/test-db", "--kvh-context", "l0_cpu")
    assert _outcomes(result) == {"test_cache": "passed"}
    wrong = project.runpytest("--kvh-test-db", "lists/test-db", "--kvh-context", "l0_b200")
    assert wrong.ret == pytest.ExitCode.USAGE_ERROR
    wrong.stderr.fnmatch_lines(["*test-db: no context 'l0_b200'; this test-db holds l0_cpu, l0_h100"])


def test_no_block_hint_repeats_the_flags(project: pytest.Pytester) -> None:
    result = project.runpytest("--kvh-test-db", "lists/test-db", "--kvh-context", "l0_h100", "--kvh-gpu",
                               "NVIDIA B200", "--kvh-gpu-count", "1", "--kvh-backend", "torch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*no block of context l0_h100 of lists/test-db applies to *; `kvharness list --explain "
        "--test-db lists/test-db --stage pre_merge --gpu 'NVIDIA B200' --gpu-count 1 --backend "
        "torch --context l0_h100` says why"])


def test_plain_list_with_waives_file_and_test_prefix(project: pytest.Pytester) -> None:
    _plain_list(project, [])


def test_plain_list_with_waives_file_and_test_prefix_wide(project: pytest.Pytester) -> None:
    """The same under two xdist workers (post-merge: the plugin's other xdist runs are
    pre-merge)."""
    _plain_list(project, ["-n", "2"])


def _plain_list(project: pytest.Pytester, workers: list[str]) -> None:
    """TensorRT-LLM's plain list, waives file and junit prefix, run with `workers`."""
    project.path.joinpath("l0_h100.txt").write_text(
        "tests/test_k.py::test_fp8_gemm\n"
        "tests/test_k.py -k partition  # TensorRT-LLM's generated lists keep comments\n")
    result = project.runpytest("--test-list", "l0_h100.txt", "--waives-file", "lists/waives.txt",
                               "--test-prefix", "H100-PyTorch-1", "--junitxml", "junit.xml",
                               *workers)
    result.assert_outcomes(passed=3, skipped=1, deselected=0 if workers else 2)
    cases = {(c.get("classname"), c.get("name")): c.find("skipped") is not None for c in
             ET.parse(project.path / "junit.xml").getroot().iter("testcase")}
    assert cases == {
        ("H100-PyTorch-1.tests.test_k", "test_fp8_gemm"): False,
        ("H100-PyTorch-1.tests.test_k", "test_attention[partition0]"): False,
        ("H100-PyTorch-1.tests.test_k", "test_attention[partition1]"): False,
        ("H100-PyTorch-1.tests.test_k", "test_attention[partition2]"): True,  # full:H100
    }


def test_list_order_runs_tests_as_listed(project: pytest.Pytester) -> None:
    project.path.joinpath("qa.txt").write_text(
        "tests/test_k.py::test_cache\ntests/test_k.py::test_attention[partition2]\n"
        "tests/test_k.py::test_fp8_gemm\n")
    ran = project.runpytest("--test-list", "qa.txt", "--kvh-list-order", "-v")
    order = [line.split("::")[1].split()[0] for line in ran.stdout.lines if " PASSED" in line]
    assert order == ["test_cache", "test_attention[partition2]", "test_fp8_gemm"]
    default = project.runpytest("--test-list", "qa.txt", "-v")
    order = [line.split("::")[1].split()[0] for line in default.stdout.lines if " PASSED" in line]
    assert order == ["test_attention[partition2]", "test_fp8_gemm", "test_cache"]


def test_a_test_in_no_list_fails_the_run_with_its_home(project: pytest.Pytester) -> None:
    project.path.joinpath("tests", "test_new.py").write_text("def test_forgotten(): pass\n")
    result = project.runpytest("--kvh-test-db", "lists/test-db")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, deselected=6)
    result.stdout.fnmatch_lines([
        "*kvharness: tests in no list*",
        "tests/test_new.py::test_forgotten: in no list; it probably belongs in l0_cpu?0? "
        "(*l0_cpu.yml:3), next to 'tests/test_k.py::test_cache'",
        "1 collected tests are in no list of lists/test-db: they never run in CI.*",
        "*= 1 passed, 6 deselected, 1 in no list in *",
    ])


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        pytest.param("    terms:\n      stage: pre_merge\n      backend: pytorch",
                     "    term:\n      stage: pre_merge\n      backend: pytorch",
                     "*l0_h100?0?.condition: unknown key 'term'; allowed: ranges, wildcards, terms",
                     id="misspelled-section"),
        pytest.param("attention_backend: flashinfer", "backend: flashinfer",
                     "*terms.backend: 'flashinfer' is an attention backend; 'backend' is the "
                     "job's*", id="attention-backend-as-backend"),
        pytest.param("supports_fp8: true", "supports_fp8: 1",
                     "*terms.supports_fp8: 1 is not one of true, false", id="feature-not-bool"),
    ],
)
def test_bad_keys_and_values_are_errors_in_one_voice(
    project: pytest.Pytester, old: str, new: str, message: str
) -> None:
    path = project.path / "lists" / "test-db" / "l0_h100.yml"
    path.write_text(L0_H100.replace(old, new, 1))
    result = project.runpytest("--kvh-test-db", "lists/test-db")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])

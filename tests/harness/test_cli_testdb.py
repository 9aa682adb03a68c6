"""`kvharness validate --syntax-only`, `kvharness test-db` and `kvharness sysinfo` on
TensorRT-LLM's real files (issue 24): the pre-commit check without collection, the
renders `trt-test-db` would write, compared with hand-checked expectations, and the
machine description as get_sysinfo.py's "Mako options"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

TRTLLM = Path(__file__).parent / "lists" / "trtllm"
FIXTURES = TRTLLM / "fixtures"
WAIVES = FIXTURES / "waives.txt"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_real_files_pass_the_syntax_check_without_collecting() -> None:
    """`validate --syntax-only` on the four real lists and the 455-line waives file: exit
    0, no pytest run, torch never imported (a fresh interpreter, as pre-commit runs it)."""
    probe = ("import sys, subprocess\n"
             "subprocess.run = None  # collection would run pytest in a subprocess\n"
             "from harness.cli import main\n"
             f"code = main(['validate', '--syntax-only', '-d', {str(FIXTURES)!r}, "
             f"'--waives', {str(WAIVES)!r}])\n"
             "assert 'torch' not in sys.modules and 'kvcache' not in sys.modules, 'heavy import'\n"
             "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == ("ok, 52 warnings: 20 blocks, 540 entries, 455 waives, "
                                            "syntax only, no tests collected")


def test_syntax_only_reports_every_problem_with_exit_1(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    db = tmp_path / "test-db"
    db.mkdir()
    text = (FIXTURES / "l0_a100.yml").read_text()
    (db / "l0_a100.yml").write_text(text.replace("stage: pre_merge", "stage: premerge", 1)
                                    .replace('-m "part0"', '-m "part0 and"', 1))
    (db / "l0_h100.yml").write_text((FIXTURES / "l0_h100.yml").read_text())
    waives = tmp_path / "waives.txt"
    waives.write_text("unittest/a.py SKIP (x\nunittest/b.py SKIP\n")
    code, out, _ = run(capsys, "validate", "--syntax-only", "-d", str(db), "--waives", str(waives))
    assert code == 1
    lines = out.splitlines()
    assert [line.split(": ", 1)[0].rsplit("/", 1)[-1] for line in lines[:3]] == [
        "l0_a100.yml:13", "l0_a100.yml:16", "waives.txt:1"]
    assert lines[-1].startswith("3 problems, 1 warnings: 0 blocks")
    # --context reads only its file: l0_h100 is fine.
    code, out, _ = run(capsys, "validate", "--syntax-only", "-d", str(db), "--context", "l0_h100",
                       "--waives", str(tmp_path / "none.txt"))
    assert code == 1 and "l0_a100" not in out and "none.txt: waives file does not exist" in out


EXPECTED = TRTLLM / "expected"
# The context each case's machine runs (TensorRT-LLM's stage -> test-db context).
CONTEXTS = {"h100": "l0_h100", "a100": "l0_a100", "b200": "l0_b200", "b100ts2": "l0_b200",
            "dgx_h100": "l0_dgx_h100", "sbatch_dgx_h100": "l0_dgx_h100"}
CASES = sorted(p.stem for p in EXPECTED.glob("*.json"))


def _context(case: str) -> str:
    return next(CONTEXTS[p] for p in sorted(CONTEXTS, key=len, reverse=True)
                if case.startswith(p + "_"))


def _expected(case: str, exact: bool) -> str:
    strict = EXPECTED / f"{case}.exact.txt"
    return (strict if exact and strict.exists() else EXPECTED / f"{case}.txt").read_text()


@pytest.mark.parametrize("mode", ["--match", "--match-exact"])
@pytest.mark.parametrize("case", CASES)
def test_renders_equal_the_hand_checked_ones(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             case: str, mode: str) -> None:
    """`kvharness test-db` as TensorRT-LLM's CI calls `trt-test-db`, for an H100 (pytorch,
    ray, cpp, tensorrt, fmha, no backend), an A100, a production B200 and the b100-ts2 CI
    board that runs the B200 stages, and a 4-GPU DGX H100 (several stages, backends and
    auto_trigger values, a 2-GPU job, an sbatch job): the file equals the hand-checked
    render line for line, markers kept, in file order."""
    out = tmp_path / f"{case}.txt"
    code, _, err = run(capsys, "test-db", "-d", str(FIXTURES), "--context", _context(case),
                       "--test-names", "--output", str(out), mode,
                       (EXPECTED / f"{case}.json").read_text())
    assert (code, err) == (0, "")
    assert out.read_text() == _expected(case, mode == "--match-exact")


def test_the_cases_cover_what_the_issue_asks() -> None:
    lines = {case: len(_expected(case, False).splitlines()) for case in CASES}
    assert lines["h100_pre_pytorch"] == 92 and lines["a100_pre_pytorch"] == 25
    assert lines["b200_pre_pytorch"] == 0 and lines["b100ts2_pre_pytorch"] == 43  # ambiguity 4
    assert (lines["dgx_h100_pre_pytorch_others"], lines["dgx_h100_pre_pytorch_deepseek"],
            lines["dgx_h100_post_tensorrt_others"], lines["dgx_h100_2gpu_pre_pytorch_others"]) \
        == (22, 47, 20, 0)
    assert len(_expected("h100_pre_nobackend", True).splitlines()) == 0  # the modes differ


MATRIX = sorted(p.name for p in (EXPECTED / "matrix").glob("*.txt"))


def test_every_case_against_every_other_context_renders_as_checked() -> None:
    """The negative controls: each description against the contexts it does not run
    (all empty: an H100 job takes nothing from l0_dgx_h100, ...), and the newer stored
    l0_b200 (fixtures/alt) for three B200 cases."""
    from harness.lists.db import load_test_db
    from harness.lists.testdb import parse_description, render

    dbs = {}
    wrong = []
    for name in MATRIX:
        stem = name.removesuffix(".txt")
        exact = stem.endswith(".exact")
        case, context = stem.removesuffix(".exact").split("__")
        folder = FIXTURES / "alt" if context.startswith("alt_") else FIXTURES
        context = context.removeprefix("alt_")
        db = dbs.setdefault((folder, context), load_test_db(folder, context))
        got = render(db, parse_description((EXPECTED / f"{case}.json").read_text(), "--match"),
                     exact)
        if "".join(f"{line}\n" for line in got) != (EXPECTED / "matrix" / name).read_text():
            wrong.append(name)
    assert len(MATRIX) == 159 and wrong == []
    assert sum(bool((EXPECTED / "matrix" / n).read_text()) for n in MATRIX) == 2  # alt l0_b200


def test_without_a_match_every_entry_is_rendered(capsys: pytest.CaptureFixture[str]) -> None:
    """`trt-test-db -d DIR --test-names` (TensorRT-LLM's check_test_list.py): every entry of
    every context, in file order."""
    code, out, _ = run(capsys, "test-db", "-d", str(FIXTURES), "--test-names")
    assert code == 0 and len(out.splitlines()) == 540
    assert out.splitlines()[0] == 'unittest/llmapi/test_llm_pytorch.py -m "part0"'  # l0_a100


def test_sysinfo_prints_mako_options_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--gpu", "NVIDIA H100 PCIe", "--gpu-count", "1", "--distribution", "ubuntu",
             "--job", "backend=pytorch", "--job", "auto_trigger=others"]
    code, out, _ = run(capsys, "sysinfo", *flags)
    lines = out.splitlines()
    assert code == 0 and lines[0] == "Mako options:"
    for line in ("gpu=H100 PCIE", "system_gpu_count=1", "linux_distribution_name=ubuntu",
                 "compute_capability=9.0", "supports_fp8=True", "stage=pre_merge",
                 "orchestrator=mpi", "backend=pytorch", "auto_trigger=others"):
        assert line in lines
    code, out, _ = run(capsys, "sysinfo", "--json", *flags)
    info = json.loads(out)
    assert (info["gpu"], info["system_gpu_count"], info["compute_capability"]) == ("H100 PCIE", 1,
                                                                                   9.0)


def test_test_db_takes_what_sysinfo_prints(tmp_path: Path) -> None:
    """`kvharness test-db ... --match-exact "$(kvharness sysinfo --json)"`, in a shell, on
    this (Debian) machine pretending the H100_PCIe-PyTorch-1 job: the hand-checked render."""
    flags = ('--gpu "NVIDIA H100 PCIe" --gpu-count 1 --distribution ubuntu '
             "--job backend=pytorch --job auto_trigger=others")
    cli = f"{sys.executable} -m harness.cli"
    out = tmp_path / "l0_h100.txt"
    command = (f'{cli} test-db -d {FIXTURES} --context l0_h100 --test-names --output {out} '
               f'--match-exact "$({cli} sysinfo --json {flags})"')
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert out.read_text() == _expected("h100_pre_pytorch", True)

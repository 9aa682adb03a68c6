"""Run the GPU check: the stages in order, each a pytest process, within one time budget.

Every stage gets the same deadline (start + budget): its tests skip once it has passed,
and the process is killed (with its whole process group: nvcc compiles included) when
it is reached. The time and the wait for a stage come from a `Clock`
(harness.gpu_check.clock: the wall clock unless the caller, a test, passes another). A
test that hangs is ended by pytest-timeout (--test-timeout), which ends its stage's
process; the next stage still runs. Stages that did not start are reported with the
reason. Nothing here needs a network or an extra package: pytest and pytest-timeout
come with the test extra; the benchmarks stage needs the bench extra and is skipped,
saying so, without it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from harness.gpu_check.clock import WALL_CLOCK, Clock
from harness.gpu_check.plugin import DEADLINE_OPTION, LOG_OPTION, read_log
from harness.gpu_check.report import Report, StageResult
from harness.gpu_check.stages import STAGE_NAMES, STAGES, Stage

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BUDGET_S = 470.0  # + KILL_GRACE_S + the report: within 8 minutes
DEFAULT_TEST_TIMEOUT_S = 300
# A stage with less than this left is not started: a pytest process needs seconds just
# to import torch and collect.
MIN_STAGE_S = 10.0
# A test still running at the deadline gets this long to finish before its process is
# killed (tests that would start later are skipped at the deadline itself).
KILL_GRACE_S = 5.0
STALE = ("report.json", "report.md", "bench.json", "*.jsonl", "junit-*.xml", "*.log")


def cuda_unavailable_reason() -> str | None:
    """Why nothing can run on a GPU here, or None when torch sees a CUDA device."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else \
            f"built for CUDA {torch.version.cuda}, but no device or driver is visible"
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
    return None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _first_line(cmd: Sequence[str], last: bool = False) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unavailable ({type(err).__name__})"
    lines = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
    if done.returncode or not lines:
        return f"unavailable (exit {done.returncode})"
    return lines[-1] if last else lines[0]


def _nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [shutil.which("nvcc")]
    if cuda_home:
        candidates.append(str(Path(cuda_home) / "bin" / "nvcc"))
    exe = next((c for c in candidates if c and Path(c).is_file()), None)
    if exe is None:
        return "absent (FlashInfer then needs its prebuilt kernel cache)"
    return _first_line([exe, "--version"], last=True)


def probe_environment() -> dict[str, str]:
    """Versions and the GPU, as the report's header shows them (CUDA must be available)."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return {
        "GPU": f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}",
        "compute capability": f"{major}.{minor}",
        "driver": _first_line(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"]),
        "torch": torch.__version__,
        "torch CUDA": str(torch.version.cuda),
        "nvcc": _nvcc(),
        "ninja": _first_line(["ninja", "--version"]),  # FlashInfer's JIT builds with it
        "flashinfer-python": next((v for v in map(_version, ("flashinfer-python", "flashinfer"))
                                   if v != "absent"), "absent"),
        "flashinfer-cubin": _version("flashinfer-cubin"),
        "flashinfer-jit-cache": _version("flashinfer-jit-cache"),
        "python": platform.python_version(),
        "commit": _first_line(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
    }


def _pytest_command(stage: Stage, results: Path, deadline: float,
                    test_timeout: int) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *stage.targets, "-q", "-p", "no:cacheprovider",
           "-p", "harness.gpu_check.plugin", f"{DEADLINE_OPTION}={deadline}",
           f"{LOG_OPTION}={results / f'{stage.name}.jsonl'}",
           f"--junitxml={results / f'junit-{stage.name}.xml'}"]
    if not any(ep.name == "kvharness" for ep in importlib.metadata.entry_points(group="pytest11")):
        cmd += ["-p", "harness.plugin"]  # not installed: load the markers' plugin by module
    if stage.keyword is not None:
        cmd += ["-k", stage.keyword]
    if importlib.util.find_spec("pytest_timeout") is not None:
        # thread: a test stuck in a CUDA call never returns to Python to be interrupted.
        cmd += ["--timeout", str(test_timeout), "--timeout-method", "thread"]
    return cmd + [a.format(results=results) for a in stage.extra_args]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group may have ended just now
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_stage(stage: Stage, results: Path, deadline: float, test_timeout: int,
              min_stage_s: float = MIN_STAGE_S, grace_s: float = KILL_GRACE_S,
              clock: Clock = WALL_CLOCK) -> StageResult:
    """Run one stage's pytest process until it ends, or kill it when `clock` reaches
    `grace_s` after `deadline` (on clock.now()'s scale; the process skips the tests that
    would start after it, by its own time.time()); its output goes to
    results/<stage>.log. Not started with less than `min_stage_s` left. Never raises
    for what the tests do."""
    missing = [m for m in stage.requires if importlib.util.find_spec(m) is None]
    if missing:
        return StageResult(stage.name, stage.title, "skipped", 0.0,
                           f"needs {', '.join(missing)} (pip install -e .[test])", ())
    left = deadline - clock.now()
    if left < min_stage_s:
        return StageResult(stage.name, stage.title, "skipped", 0.0,
                           f"time budget spent ({max(left, 0):.0f} s left)", ())
    start = time.monotonic()
    with (results / f"{stage.name}.log").open("wb") as log:
        proc = subprocess.Popen(_pytest_command(stage, results, deadline, test_timeout),
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        code = clock.wait(proc, deadline + grace_s)
        if code is None:
            _kill_group(proc)
    seconds = time.monotonic() - start
    log_path = results / f"{stage.name}.jsonl"
    if code is None:
        why = "stopped at the time budget"
        return StageResult(stage.name, stage.title, "stopped", seconds, why,
                           tuple(read_log(log_path, stage.name, "stopped", why)))
    # pytest exits 0-5; anything else (pytest-timeout's os._exit, a signal) ended it early.
    why = f"its process ended early (exit {code}); see {stage.name}.log"
    checks = read_log(log_path, stage.name, "crashed", why)
    if code in (0, 1, 5) and all(c.outcome not in ("crashed", "not run") for c in checks):
        reason = "" if code != 5 else "no tests selected"
        return StageResult(stage.name, stage.title, "ran", seconds, reason, tuple(checks))
    return StageResult(stage.name, stage.title, "ended early", seconds, why, tuple(checks))


def run_check(stages: Sequence[Stage], results: Path, budget_s: float, test_timeout: int,
              environment: dict[str, str], clock: Clock = WALL_CLOCK) -> Report:
    """Run `stages` in order within `budget_s` of `clock` (plus at most KILL_GRACE_S for
    a test running at the deadline); write and return the report."""
    results.mkdir(parents=True, exist_ok=True)
    for pattern in STALE:
        for old in results.glob(pattern):
            old.unlink()
    t0 = clock.now()
    deadline = t0 + budget_s
    done = []
    for stage in stages:
        result = run_stage(stage, results, deadline, test_timeout, clock=clock)
        done.append(result)
        print(f"gpu check: {stage.name}: {result.status} in {result.seconds:.0f} s"
              + (f" ({result.reason})" if result.reason else ""), flush=True)
    report = Report(environment, budget_s, clock.now() - t0, tuple(done))
    report.write(results)
    return report


def _stage_list(text: str) -> list[Stage]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGE_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown stage(s) {unknown or text!r}; stages: "
                                         f"{', '.join(STAGE_NAMES)}")
    return [s for s in STAGES if s.name in names]


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m harness.gpu_check`: 0 when every check that ran passed (or nothing could
    run: no CUDA), 1 when one failed, 2 for bad flags."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.gpu_check",
        description="FlashInfer, CUDA graphs and the engine on this GPU, budgeted; "
                    "report in RESULTS/report.md and report.json.")
    parser.add_argument("--budget", type=_positive, default=DEFAULT_BUDGET_S, metavar="S",
                        help=f"wall-clock seconds for the whole check (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--test-timeout", type=int, default=DEFAULT_TEST_TIMEOUT_S, metavar="S",
                        help="seconds one test may take, first-use kernel compilation included "
                             f"(default {DEFAULT_TEST_TIMEOUT_S})")
    parser.add_argument("--results-dir", type=Path, default=Path("results/gpu"), metavar="DIR")
    parser.add_argument("--stages", type=_stage_list, default=list(STAGES), metavar="A,B",
                        help=f"run only these stages, in the check's order: {', '.join(STAGE_NAMES)}")
    parser.add_argument("--no-bench", action="store_true", help="leave out the benchmarks stage")
    parser.add_argument("--list", action="store_true", help="print the stages and exit")
    args = parser.parse_args(argv)
    stages = [s for s in args.stages if not (args.no_bench and s.name == "benchmarks")]
    if args.list:
        for s in stages:
            print(f"{s.name}: {s.title}")
        return 0
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"gpu check: nothing ran: {reason}")
        return 0
    results = args.results_dir if args.results_dir.is_absolute() else Path.cwd() / args.results_dir
    report = run_check(stages, results, args.budget, args.test_timeout, probe_environment())
    counts = ", ".join(f"{n} {k}" for k, n in sorted(report.counts.items()))
    print(f"gpu check: {'passed' if report.passed else 'FAILED'} ({counts}) in "
          f"{report.elapsed_s:.0f} s; {results / 'report.md'}")
    return 0 if report.passed else 1

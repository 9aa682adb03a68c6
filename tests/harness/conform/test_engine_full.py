"""The pinned engines' full conformance runs (installed on first use, then cached), two
runs of each giving one report.json but for timings, a source tree with and without a
planted bug, and the findings of older releases, which must stay found where those are
installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.conform import install
from harness.conform.checks import CHECKS
from harness.conform.locks import find_lock
from harness.conform.runner import conform

SEEDS = 8


@pytest.mark.parametrize("spec", ["vllm==0.33.0", "sglang==0.5.23", "sglang_unified==0.5.23"],
                         ids=["vllm", "sglang", "sglang-unified"])
def test_the_pinned_release_passes_the_whole_run(spec: str, tmp_path: Path) -> None:
    report = conform(spec, tmp_path, seeds=SEEDS, bench_quick=True, say=print)
    assert report.exit_code == 0, report.reason or [(c.name, c.message) for c in report.failed]
    assert len(report.checks) == len(CHECKS) + SEEDS
    engines = {row["adapter"].split()[0] for row in report.bench}
    assert engines == {"kvcache", spec.split("==")[0]}


# docs/conformance.md, "Findings" 1-7: (release, the check that shows it, the oracle)
FINDINGS = [
    pytest.param("vllm==0.28.0", "scope_isolation", "count", id="vllm-0.28-salt-is-lora-name"),
    pytest.param("vllm==0.26.0", "refused_then_retried", "refusal",
                 id="vllm-0.26-refused-lookup-counted"),
    pytest.param("vllm==0.10.2", "scope_isolation", "api", id="vllm-0.10-lora-events-raise"),
    pytest.param("sglang==0.5.12", "scope_isolation", "count", id="sglang-0.5.12-salt-is-lora-id"),
    pytest.param("sglang==0.5.12", "scope_event_hashes", "scenario",
                 id="sglang-0.5.12-events-carry-no-scope"),
    pytest.param("sglang==0.5.5", "cold_then_warm", "events", id="sglang-0.5.5-lookup-churn"),
    pytest.param("sglang==0.5.5", "repeated_blocks", "events",
                 id="sglang-0.5.5-position-blind-hashes"),
]


@pytest.mark.parametrize(("spec", "check", "oracle"), FINDINGS)
def test_a_known_finding_is_still_found(spec: str, check: str, oracle: str,
                                        tmp_path: Path) -> None:
    engine, version = spec.split("==")
    if install.installed(find_lock(engine, version)) is None:
        pytest.skip(f"{spec} is not installed in {install.cache_dir()}")
    report = conform(spec, tmp_path, seeds=0, only=[check], say=lambda _: None)
    assert report.exit_code == 1
    (result,) = report.checks
    assert (result.status, result.oracle) == ("fail", oracle)
    assert 0 < len(result.ops) <= result.num_ops


def test_a_source_tree_is_checked_and_a_planted_bug_found_installing(tmp_path: Path) -> None:
    """test_engine_tree.py's run, with the release's venv and the pins-only venv installed
    first where they are missing (each once; later runs reuse them)."""
    from tests.harness.conform.test_engine_tree import run_tree
    from tests.harness.conform.trees import RELEASE

    engine, version = RELEASE.split("==")
    lock = find_lock(engine, version)
    install.ensure(lock, print)
    install.ensure(lock, print, engine_wheel=False)
    run_tree(tmp_path)


@pytest.mark.parametrize("spec", ["vllm==0.33.0", "sglang==0.5.23"], ids=["vllm", "sglang"])
def test_two_engine_runs_write_the_same_report_but_timings(spec: str, tmp_path: Path) -> None:
    from tests.harness.conform.test_determinism import two_runs

    first, second = two_runs(spec, tmp_path, seeds=2,
                             only=["cold_then_warm", "scope_event_hashes", "repeated_blocks"])
    assert first.count('"name": "fuzz_seed_') == 2 and '"scope_event_hashes"' in first
    assert first == second


def test_a_release_without_a_lock_is_resolved_and_proven(tmp_path: Path) -> None:
    """harness.conform.resolve end to end on a small release (SGLang 0.5.6.post1, a 4 MB
    wheel) into an empty cache (the wheels folder shared, so it downloads once): the lock
    starts from 0.5.6's, borrows nothing it does not need, validates, and its venv is the
    one it was proven in (a run reuses it)."""
    from harness.conform.resolve import resolve, resolved_dir

    base = tmp_path / "engines"
    base.mkdir()
    (install.cache_dir() / "wheels").mkdir(parents=True, exist_ok=True)
    (base / "wheels").symlink_to(install.cache_dir() / "wheels")
    lock = resolve("sglang", "0.5.6.post1", base, print)
    assert lock.path == resolved_dir(base) / "sglang-0.5.6.post1.json" and not lock.committed
    assert lock.resolved is not None and lock.resolved["base"] in ("0.5.6", "0.5.5")
    assert "sgl_kernel" in lock.stubs.raising and "torchvision" in lock.stubs.raising
    env = install.installed(lock, base)
    assert env is not None and env.python.exists()
    assert not any(d.lower().startswith(("torch==", "nvidia")) for d in lock.deps)

"""The pinned engines' full conformance runs (installed on first use, then cached), two
runs of each giving one report.json but for timings, a source tree with and without a
planted bug, and the findings of older releases, which must stay found where those are
installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.conform import ops
from harness.conform.controller import install
from harness.conform.controller.checks import CHECKS
from harness.conform.controller.families import B
from harness.conform.controller.locks import find_lock, pinned, supported
from harness.conform.controller.report import Report
from harness.conform.controller.runner import conform, replay_file
from harness.conform.controller.targets import replay
from tests.harness.conform.cached_engines import open_cached

SEEDS = 8


# shortfin's newest release has findings of its own (SHORTFIN_FINDINGS below)
PINNED = [lock.spec for lock in pinned() if lock.engine != "shortfin"]


# findings of a pinned release, each in FINDINGS below: its run fails exactly there
PINNED_FINDINGS = {"sglang": {"extra_key_isolation"}, "sglang_unified": {"extra_key_isolation"}}


@pytest.mark.parametrize("spec", PINNED, ids=[s.split("==")[0].replace("_", "-") for s in PINNED])
def test_the_pinned_release_passes_the_whole_run(spec: str, tmp_path: Path) -> None:
    report = conform(spec, tmp_path, seeds=SEEDS, bench_quick=True, say=print)
    known = PINNED_FINDINGS.get(spec.split("==")[0], set())
    assert report.exit_code == (1 if known else 0), report.reason
    assert {c.name for c in report.failed} == known, [(c.name, c.message) for c in report.failed]
    assert len(report.checks) == len(CHECKS) + SEEDS
    engines = {row["adapter"].split()[0] for row in report.bench}
    assert engines == {"kvcache", spec.split("==")[0]}


# docs/conformance.md, "Findings": (release, the check that shows it, the oracle, the
# finding's number, which report.json's `known` names)
FINDINGS = [
    pytest.param("vllm==0.28.0", "scope_isolation", "count", 1,
                 id="vllm-0.28-salt-is-lora-name"),
    pytest.param("vllm==0.26.0", "refused_then_retried", "refusal", 2,
                 id="vllm-0.26-refused-lookup-counted"),
    pytest.param("vllm==0.24.0", "pressure_spares_own_prefix", "refusal", 2,
                 id="vllm-0.24-refused-lookup-counted"),
    pytest.param("vllm==0.10.2", "scope_isolation", "api", 3, id="vllm-0.10-lora-events-raise"),
    pytest.param("vllm==0.28.0", "lora_name_repointed", "count", 15,
                 id="vllm-0.28-lora-name-repointed"),
    pytest.param("sglang==0.5.12", "scope_isolation", "count", 4,
                 id="sglang-0.5.12-salt-is-lora-id"),
    pytest.param("sglang==0.5.12", "scope_event_hashes", "scenario", 5,
                 id="sglang-0.5.12-events-carry-no-scope"),
    pytest.param("sglang==0.5.5", "cold_then_warm", "events", 17,
                 id="sglang-0.5.5-first-block-without-parent"),
    pytest.param("sglang==0.5.6", "cold_then_warm", "events", 6, id="sglang-0.5.6-lookup-churn"),
    pytest.param("sglang==0.5.16", "eviction_order", "scenario", 19,
                 id="sglang-0.5.16-evicts-the-whole-size"),
    pytest.param("sglang==0.5.5", "repeated_blocks", "events", 7,
                 id="sglang-0.5.5-position-blind-hashes"),
    pytest.param("vllm==0.26.0", "host_tier", "api", 18,
                 id="vllm-0.26.0-abort-mid-prefill-under-offloading"),
    pytest.param("sglang==0.5.23", "extra_key_isolation", "count", 16,
                 id="sglang-0.5.23-extra-key-is-lora-id"),
    pytest.param("sglang==0.5.22", "extra_key_isolation", "count", 16,
                 id="sglang-0.5.22-extra-key-is-lora-id"),
    pytest.param("sglang_unified==0.5.23", "extra_key_isolation", "count", 16,
                 id="sglang-unified-0.5.23-extra-key-is-lora-id"),
    pytest.param("sglang_unified==0.5.21", "window_off_page", "capacity", 21,
                 id="sglang-unified-0.5.21-off-page-window-unlocks-a-running-prompt"),
    pytest.param("sglang_unified==0.5.22", "window_off_page", "capacity", 21,
                 id="sglang-unified-0.5.22-off-page-window-unlocks-a-running-prompt"),
]


@pytest.mark.parametrize(("spec", "check", "oracle", "number"), FINDINGS)
def test_a_known_finding_is_still_found(spec: str, check: str, oracle: str, number: int,
                                        tmp_path: Path) -> None:
    engine, version = spec.split("==")
    if install.installed(find_lock(engine, version)) is None:
        pytest.skip(f"{spec} is not installed in {install.cache_dir()}")
    report = conform(spec, tmp_path, seeds=0, only=[check], say=lambda _: None)
    assert report.exit_code == 1
    (result,) = report.checks
    assert (result.status, result.oracle, result.known.get("number")) == \
        ("fail", oracle, number)
    assert 0 < len(result.ops) <= result.num_ops
    # its replay file re-runs it on the same release: still found
    assert replay_file(spec, tmp_path / f"{check}.replay.json", say=lambda _: None) == 1


# docs/conformance.md, "Known limitations": (release, the check that says it)
# (0.5.23 is none: its own scheduler code, which drives the tree there, names each LoRA
# request to the event recorder, and the LoRA's blocks publish hashes of their own)
LIMITATIONS = [
    pytest.param("sglang==0.5.22", "scope_event_hashes", id="sglang-0.5.22-lora-event-hashes"),
    # cache_salt arrived in 0.5.18; 0.5.19's contract is 0.5.18's, its salt detected
    pytest.param("sglang==0.5.19", "scope_event_hashes", id="sglang-0.5.19-lora-event-hashes"),
    pytest.param("sglang==0.5.18", "scope_event_hashes", id="sglang-0.5.18-lora-event-hashes"),
]


@pytest.mark.parametrize(("spec", "check"), LIMITATIONS)
def test_a_known_limitation_is_still_said(spec: str, check: str, tmp_path: Path) -> None:
    engine, version = spec.split("==")
    if install.installed(find_lock(engine, version)) is None:
        pytest.skip(f"{spec} is not installed in {install.cache_dir()}")
    report = conform(spec, tmp_path, seeds=0, only=[check], say=lambda _: None)
    assert (report.exit_code, report.verdict) == (0, "known limitations"), report.reason
    (result,) = report.checks
    assert result.status == "limitation" and "sglang/issues/39991" in result.message
    assert (tmp_path / f"{check}.replay.json").is_file()


# docs/conformance.md, "shortfin": (release, the check that shows it, its oracle, what
# else the same check must have found); 3.6.0 and 3.9.0 are installed on first use
SHORTFIN_FINDINGS = [
    pytest.param("3.9.0", "same_prompt_twice", "capacity", "", id="9-duplicate-unreferenced"),
    pytest.param("3.9.0", "live_blocks_survive_eviction", "capacity", "provenance",
                 id="9-evicted-while-in-use"),
    pytest.param("3.9.0", "pressure_spares_own_prefix", "capacity", "names pages [3] twice",
                 id="10-evicts-its-own-match"),
    pytest.param("3.9.0", "decoded_then_edited", "capacity", "provenance",
                 id="11-decode-page-dropped"),
    pytest.param("3.8.0", "decode_growth", "capacity", "owned by nobody",
                 id="11-decode-page-leaks"),
    pytest.param("3.6.0", "cold_then_warm", "capacity", "owned by nobody",
                 id="8-unpublished-page-leaks"),
    pytest.param("3.6.0", "pressure_spares_own_prefix", "refusal", "still referenced",
                 id="12-refusal-pins-its-match"),
    pytest.param("3.3.0", "same_prompt_twice", "integrity", "owned by nobody",
                 id="13-second-publish-replaces-the-first"),
    pytest.param("3.3.0", "decode_growth", "capacity", "no block recorded",
                 id="14-decode-step-gets-no-page"),
]


@pytest.mark.parametrize(("version", "check", "oracle", "also"), SHORTFIN_FINDINGS)
def test_a_shortfin_finding_is_still_found(version: str, check: str, oracle: str,
                                          also: str, tmp_path: Path) -> None:
    lock = find_lock("shortfin", version)
    if version not in ("3.6.0", "3.9.0") and install.installed(lock) is None:
        pytest.skip(f"shortfin=={version} is not installed in {install.cache_dir()}")
    report = conform(f"shortfin=={version}", tmp_path, seeds=0, only=[check],
                     say=lambda _: None)
    assert report.exit_code == 1, report.reason
    (result,) = report.checks
    assert (result.status, result.oracle) == ("fail", oracle), result.message
    assert also in "\n".join([result.message, *result.also])
    assert 0 < len(result.ops) <= result.num_ops


def test_sglang_holds_the_pages_its_decoded_tokens_need(tmp_path: Path) -> None:
    # a held-out fuzz failure on a planted bug shrank to these two ops, which failed the
    # capacity oracle on the unplanted release too (5 pages expected, 4 held): the
    # adapter had logged the admission's tokens as the list its append then extended
    with open_cached(find_lock("sglang", "0.5.23"), tmp_path) as target:
        found = replay(target, [ops.admit("s26", range(1, 15)), ops.append("s26", [15, 16])],
                       12, B)
    assert found == []


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
    """harness.conform.controller.resolve end to end on a small release (SGLang 0.5.6.post1, a 4 MB
    wheel) into an empty cache (the wheels folder shared, so it downloads once): the lock
    starts from 0.5.6's, borrows nothing it does not need, validates, and its venv is the
    one it was proven in (a run reuses it). 0.5.6.post1's own lock is committed since, so
    the run sees the committed locks without it."""
    from harness.conform.controller.locks import LOCK_DIR
    from harness.conform.controller.resolve import resolve, resolved_dir

    lock_dir = tmp_path / "locks"
    shutil.copytree(LOCK_DIR, lock_dir)
    (lock_dir / "sglang-0.5.6.post1.json").unlink()
    base = tmp_path / "engines"
    base.mkdir()
    (install.cache_dir() / "wheels").mkdir(parents=True, exist_ok=True)
    (base / "wheels").symlink_to(install.cache_dir() / "wheels")
    lock = resolve("sglang", "0.5.6.post1", base, print, lock_dir)
    assert lock.path == resolved_dir(base) / "sglang-0.5.6.post1.json" and not lock.committed
    assert lock.resolved is not None and lock.resolved["base"] in ("0.5.6", "0.5.5")
    assert "sgl_kernel" in lock.stubs.raising and "torchvision" in lock.stubs.raising
    env = install.installed(lock, base)
    assert env is not None and env.python.exists()
    assert not any(d.lower().startswith(("torch==", "nvidia")) for d in lock.deps)


def cached_vllm_run(version: str, check: str, tmp_path: Path) -> Report:
    """`conform vllm==version` with one check and no fuzz, in the cached venv (skipped
    where it is not installed); returns the report."""
    lock = find_lock("vllm", version)
    if install.installed(lock) is None:
        pytest.skip(f"vllm=={version} is not installed in {install.cache_dir()}")
    report = conform(f"vllm=={version}", tmp_path, seeds=0, only=[check], say=lambda _: None)
    if report.exit_code == 2 and install.installed(lock) is None:  # its venv went meanwhile
        pytest.skip(f"vllm=={version}'s venv was removed during the run: {report.reason}")
    assert report.exit_code != 2, report.reason
    return report


# vllm-project/vllm#48860 (0.27.0) records the prefix-cache stats in Scheduler.schedule,
# at admission: with vLLM's own scheduler driving the cache, 0.26.0 counts a refused
# lookup because its scheduler does and 0.27.0 does not because its scheduler does not
@pytest.mark.parametrize(("version", "status"), [("0.26.0", "fail"), ("0.27.0", "pass")])
def test_the_stats_fix_is_judged_in_vllms_own_scheduler(version: str, status: str,
                                                       tmp_path: Path) -> None:
    report = cached_vllm_run(version, "refused_then_retried", tmp_path)
    assert any("runs Scheduler.schedule" in n for n in report.contract["notes"])
    (result,) = report.checks
    assert result.status == status, result.message


# The scheduler-driven adapter falls back to the manager alone where a release's
# Scheduler does not construct; no locked release should need it (0.29.0 and 0.30.0 did,
# for a lock without einops and a model config without uses_xdrope)
@pytest.mark.parametrize("version", supported()["vllm"])
def test_every_locked_vllm_runs_its_own_scheduler(version: str, tmp_path: Path) -> None:
    report = cached_vllm_run(version, "cold_then_warm", tmp_path)
    assert any("runs Scheduler.schedule" in n for n in report.contract["notes"]), \
        report.contract["notes"]


# Where a prompt's tail state stays: 0.28-0.31 at its last hash boundary, 0.32 on before
# its last token (the manager retains that checkpoint alone); 0.30-0.31 already have
# get_mamba_prefill_checkpoint_position, which the rule was first chosen by, and failed
@pytest.mark.parametrize("version", ["0.28.0", "0.31.0", "0.33.0"])
def test_hybrid_state_follows_each_releases_tail_rule(version: str, tmp_path: Path) -> None:
    report = cached_vllm_run(version, "hybrid_state", tmp_path)
    (result,) = report.checks
    assert result.status == "pass", result.message


# A decoded request carries its sampled tokens in an output, which takes its prefill
# stats (Request.take_prefill_stats); 0.21-0.25's scheduler asserts, for a request whose
# stats are still there, that its hit is within the prompt: resumed past its prompt with
# the stats left on it, the adapter (not vLLM) tripped that assert
@pytest.mark.parametrize("version", ["0.24.0", "0.33.0"])
def test_a_resumed_request_passes_in_vllms_own_scheduler(version: str, tmp_path: Path) -> None:
    report = cached_vllm_run(version, "preemption_resume", tmp_path)
    (result,) = report.checks
    assert result.status == "pass", result.message


PLANT = {  # vllm#48860 undone in Scheduler.schedule: every lookup counted, refused or not
    """                # Record at admission so unscheduled lookups are not counted.
                if did_prefix_cache_lookup:
                    self.kv_cache_manager.record_prefix_cache_stats(
                        request, num_new_local_computed_tokens
                    )
""": "",
    """                    ) = self._get_local_prefix_cache_hit(request, max_cache_hit_length)
""": """                    ) = self._get_local_prefix_cache_hit(request, max_cache_hit_length)
                    self.kv_cache_manager.record_prefix_cache_stats(
                        request, num_new_local_computed_tokens
                    )
"""}
# runs in the engine's venv, the planted tree first on its path: two families, judged
DRIVER = """
import json, sys
from harness.conform.adapters import vllm_scheduler
from harness.conform.controller.checks import check_named
from harness.conform.controller.runner import run_check
from harness.conform.controller.targets import LocalTarget
from harness.conform.stubs import StubSpec
import vllm
target = LocalTarget(vllm_scheduler.load(StubSpec.from_dict({})))
out = {name: run_check(target, check_named(name)).oracle for name in sys.argv[1:]}
print(json.dumps({"vllm": vllm.__file__, "oracles": out}))
"""


def test_a_planted_regression_of_the_stats_fix_is_found(tmp_path: Path) -> None:
    """The pinned vLLM's Python files unpacked, vllm#48860 undone in its scheduler: the
    refused lookups it then counts are refusal findings (the release itself passes)."""
    lock = next(lock for lock in pinned() if lock.engine == "vllm")
    env = install.installed(lock)
    if env is None:
        pytest.skip(f"{lock.spec} is not installed in {install.cache_dir()}")
    site = next(env.root.glob("venv/lib/python*/site-packages"))
    shutil.copytree(site / "vllm", tmp_path / "vllm",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    scheduler = tmp_path / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
    text = scheduler.read_text()
    for old, new in PLANT.items():
        assert text.count(old) == 1, f"{lock.spec}: the plant's anchor moved: {old!r}"
        text = text.replace(old, new)
    scheduler.write_text(text)
    checkout = Path(__file__).resolve().parents[3]
    got = subprocess.run(
        [str(env.python), "-c", DRIVER, "refused_then_retried", "pressure_spares_own_prefix"],
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{checkout}"},
        capture_output=True, text=True, check=True)
    result = json.loads(got.stdout.splitlines()[-1])
    assert result["vllm"].startswith(str(tmp_path))
    assert result["oracles"] == {"refused_then_retried": "refusal",
                                 "pressure_spares_own_prefix": "refusal"}

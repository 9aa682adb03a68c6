"""The pinned engines' full conformance runs (installed on first use, then cached), and
the findings of older releases, which must stay found where those are installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.conform.controller import install
from harness.conform.controller.checks import CHECKS
from harness.conform.controller.locks import find_lock, pinned
from harness.conform.controller.runner import conform

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


# docs/conformance.md, "Findings" 1-7 and 15: (release, the check that shows it, the oracle)
FINDINGS = [
    pytest.param("vllm==0.28.0", "scope_isolation", "count", id="vllm-0.28-salt-is-lora-name"),
    pytest.param("vllm==0.26.0", "refused_then_retried", "refusal",
                 id="vllm-0.26-refused-lookup-counted"),
    pytest.param("vllm==0.24.0", "pressure_spares_own_prefix", "refusal",
                 id="vllm-0.24-refused-lookup-counted"),
    pytest.param("vllm==0.10.2", "scope_isolation", "api", id="vllm-0.10-lora-events-raise"),
    pytest.param("sglang==0.5.12", "scope_isolation", "count", id="sglang-0.5.12-salt-is-lora-id"),
    pytest.param("sglang==0.5.12", "scope_event_hashes", "scenario",
                 id="sglang-0.5.12-events-carry-no-scope"),
    pytest.param("sglang==0.5.5", "cold_then_warm", "events", id="sglang-0.5.5-lookup-churn"),
    pytest.param("sglang==0.5.5", "repeated_blocks", "events",
                 id="sglang-0.5.5-position-blind-hashes"),
    # 15 (sgl-project/sglang#24638): a caller extra key equal to a LoRA's id
    pytest.param("sglang==0.5.23", "extra_key_isolation", "count",
                 id="sglang-0.5.23-extra-key-is-lora-id"),
    pytest.param("sglang==0.5.22", "extra_key_isolation", "count",
                 id="sglang-0.5.22-extra-key-is-lora-id"),
    pytest.param("sglang_unified==0.5.23", "extra_key_isolation", "count",
                 id="sglang-unified-0.5.23-extra-key-is-lora-id"),
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


# vllm-project/vllm#48860 (0.27.0) records the prefix-cache stats in Scheduler.schedule,
# at admission: with vLLM's own scheduler driving the cache, 0.26.0 counts a refused
# lookup because its scheduler does and 0.27.0 does not because its scheduler does not
@pytest.mark.parametrize(("version", "status"), [("0.26.0", "fail"), ("0.27.0", "pass")])
def test_the_stats_fix_is_judged_in_vllms_own_scheduler(version: str, status: str,
                                                       tmp_path: Path) -> None:
    if install.installed(find_lock("vllm", version)) is None:
        pytest.skip(f"vllm=={version} is not installed in {install.cache_dir()}")
    report = conform(f"vllm=={version}", tmp_path, seeds=0, only=["refused_then_retried"],
                     say=lambda _: None)
    assert any("runs Scheduler.schedule" in n for n in report.contract["notes"])
    (result,) = report.checks
    assert result.status == status, result.message


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

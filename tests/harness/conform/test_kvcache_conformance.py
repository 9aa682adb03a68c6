"""kvcache's own manager passes the whole conformance run, through the command line too;
the command's exit codes (0 passed, 2 could not run) and a replay of an op list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main as kvharness
from harness.conform import ops
from harness.conform.adapters import kvcache
from harness.conform.controller.checks import CHECKS
from harness.conform.controller.families import B
from harness.conform.controller.runner import conform
from harness.conform.controller.targets import LocalTarget, replay
from harness.conform.protocol import CacheOptions, Scope


def test_kvcache_passes_every_check_and_the_fuzz(tmp_path: Path) -> None:
    lines: list[str] = []
    report = conform("kvcache", tmp_path, seeds=12, say=lines.append)
    assert report.exit_code == 0, [c.message for c in report.failed]
    assert [c.name for c in report.checks][:len(CHECKS)] == [c.name for c in CHECKS]
    assert len(report.checks) == len(CHECKS) + 12
    # kvcache's adapter drives its manager: the caller chooses the chunks; its key takes
    # no caller extra key
    assert {c.name for c in report.checks if c.status == "skip"} == {
        "scheduler_chunks", "sliding_window", "window_off_page", "window_pool_short",
        "extra_key_isolation"}
    assert all(c.status == "pass" and c.num_ops > 0 for c in report.checks
               if c.status != "skip")
    assert report.self_test["problems"] == [] and report.self_test["substitutes"] > 30
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == len(report.checks)
    assert progress[0].startswith(f"[ 1/{len(report.checks)}] cold_then_warm ")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["contract"]["engine"] == "kvcache" and data["exit_code"] == 0
    # the engine's counters at the end of a check, in its own names
    assert data["checks"][0]["stats"]["engine"]["reusedTokens"] > 0


def test_the_command_line_writes_the_report_and_replays_a_check(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    assert kvharness(["conform", "kvcache", "--report", str(out), "--seeds", "0",
                      "--check", "chunked_admission", "--bench-quick"]) == 0
    data = json.loads((out / "report.json").read_text())
    assert [c["name"] for c in data["checks"]] == ["chunked_admission"]
    assert {row["adapter"] for row in data["bench"]} == {"kvcache"}
    assert "## Speed" in (out / "report.md").read_text()
    # a passing run leaves no replay file; an op list written by hand replays
    assert list(out.glob("*.replay.json")) == []
    ops = [{"kind": "admit", "seq": "A", "tokens": list(range(18))},
           {"kind": "commit", "seq": "A", "num_tokens": 18}, {"kind": "free", "seq": "A"}]
    file = tmp_path / "by-hand.replay.json"
    file.write_text(json.dumps({"num_blocks": 8, "ops": ops}))
    assert kvharness(["conform", "kvcache", "--replay", str(file)]) == 0


def test_the_default_report_folder_is_named_by_the_parsed_spec(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert kvharness(["conform", " kvcache ", "--seeds", "0", "--check", "cold_then_warm"]) == 0
    said = capsys.readouterr().out.splitlines()
    # the SPEC that runs comes first, before anything is installed or run
    assert said[0] == "conform kvcache (the SPEC ' kvcache ' without its surrounding spaces)"
    folder = Path("results") / "conform" / "kvcache"
    assert said[-1].endswith(f"; report in {folder / 'report.md'}")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == [
        Path("results"), folder.parent, folder, folder / "report.json", folder / "report.md"]


@pytest.mark.parametrize(("spec", "reason"), [
    pytest.param("vllm==0.34.0.dev1", "vllm 0.34.0.dev1 is not a registry release: run a "
                 "checkout as vllm@PATH", id="dev"),
    pytest.param("tensorrt_llm==1.2.1", "tensorrt_llm cannot run on this machine: "
                 "TensorRT-LLM's wheels are not on the package registry", id="trtllm"),
    pytest.param("lmdeploy==0.9.0", "no adapter for 'lmdeploy'", id="unknown"),
    pytest.param("vllm>=0.30", "engine spec 'vllm>=0.30': expected NAME, NAME==VERSION or "
                 "NAME@PATH", id="range"),
])
def test_a_run_that_cannot_be_done_is_exit_2_saying_why(tmp_path: Path, spec: str,
                                                         reason: str) -> None:
    assert kvharness(["conform", spec, "--report", str(tmp_path)]) == 2
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["exit_code"] == 2 and data["reason"].startswith(reason)
    assert data["checks"] == []


def test_a_copy_source_that_would_take_the_last_block_is_claimed_instead() -> None:
    """kvcache's rule (docs/design.md, partial reuse): when protecting an unheld copy
    source would take the last block an admission needs, it claims the source, evicting
    what follows it. The bounded oracle follows it (it asserted "nothing to evict")."""
    s15 = [37, 13, 26, 6, 32, 15, 6, 7, 30, 30, 19]
    s16 = [37, 13, 26, 6, 32, 15, 2, 18, 34, 27, 31, 21, 3]
    op_list = [ops.admit("s15", s15), ops.admit("s16", s16),
               ops.admit("s17", [*s16[:11], 15, 3], Scope.lora("x", 1)),
               ops.commit("s15", 11),
               ops.free("s15"),  # 2 full blocks and a tail cached, 1 block free
               # block 0 and 2 tokens of block 1, which the tail follows: 3 new blocks,
               # and 3 to be had only by taking block 1 itself
               ops.admit("s22", [*s16[:9], 25, 2, 10, 1, 6, 12])]
    assert replay(LocalTarget(kvcache.load()), op_list, 12, B) == []


SALT = Scope(salt="00000000000000000000000000000001")


def test_a_copy_source_is_evicted_after_the_blocks_freed_before_its_admission() -> None:
    """Fuzz seed 228 of 300: s16 copies from [26, 37, 39, 27] after s14's free, so s14's
    salted blocks were released before it and go first when s21 evicts; s23 then reuses
    8 tokens. kvcache released the copy source at s14's tick and the heap's push order
    evicted it after a salted block (s23 reused 9); the count oracle, at the same tick,
    broke the tie by depth."""
    s6 = [27, 20, 24, 39, 26, 37, 39, 27, 24, 19, 39, 21]
    s14 = [5, 39, 22, 17, 38, 27, 16, 26, 22, 29, 18, 22, 5, 14]
    op_list = [ops.admit("s6", s6), ops.commit("s6", 12), ops.free("s6"),
               ops.admit("s14", s14, SALT), ops.commit("s14", 14), ops.free("s14"),
               ops.admit("s16", s6[:6]),  # [27, 20, 24, 39] and 2 tokens copied
               ops.admit("s19", [27, 20, 24, 12, 5, 34, 13, 7, 18, 30, 31, 27, 36]),
               ops.admit("s20", [*s14[:8], 26, 28, 29, 22, 11]),
               ops.admit("s21", [37, 15, 15, 30, 37, 39, 30, 30, 38]),  # evicts 3
               ops.admit("s23", s14[:10], SALT)]
    assert replay(LocalTarget(kvcache.load()), op_list, 16, B) == []


# fuzz seed 127 of 300 from s14's admission on: s14 copies from a cached [6, 38, ...],
# s15-s17 fill the pool so that s17's eviction chooses, s20 claims what is left
SEED_127_AFTER_S12 = [
    ops.admit("s14", [6, 38, 17, 25, 26]),
    ops.admit("s15", [38, 37, 7, 2, 2, 28, 7, 25, 17, 16, 15, 20]),
    ops.admit("s16", [38, 37, 10, 32, 34, 16, 3, 7, 7]),
    ops.append("s15", [5]),
    ops.admit("s17", [1, 27, 33, 4, 4]),
    ops.admit("s20", [6, 38, 24, 23])]


def test_an_eviction_tie_after_a_copy_goes_to_the_older_release() -> None:
    """Fuzz seed 127 of 300: s14 copies 2 tokens from [6, 38, 24, 23] after s12's free;
    s17's eviction then takes [33, 8] and s12's [17], keeping the copy source, and s20
    reuses 3 tokens of it (the count oracle had evicted it, the deeper of two blocks
    released at one tick)."""
    op_list = [ops.admit("s1", [6, 38, 24, 23, 33, 8]), ops.commit("s1", 6), ops.free("s1"),
               ops.admit("s12", [17]), ops.commit("s12", 1), ops.preempt("s12"),
               ops.admit("s11", [6, 38, 24, 23, 2, 31, 21, 37, 20], SALT),
               *SEED_127_AFTER_S12]
    assert replay(LocalTarget(kvcache.load()), op_list, 15, B) == []


def test_an_append_that_offloads_applies_the_offload_before_its_pass() -> None:
    """Fuzz seed 176 of 300 (a host tier): s7's append evicts s6's block 0 to host slot
    0, and s7 then writes block 0. The adapter applied the queued offload only at the
    next admission, after that write, so the host slot held s7's KV and s17's partial
    onboard from it read KV not its own (a provenance finding against the adapter)."""
    s7 = [5, 4, 6, 7, 8, 9, 10, 8, 11, 12, 13, 14, 15, 16, 17, 18]
    op_list = [ops.admit("s6", [1, 2, 3, 4]), ops.commit("s6", 4),
               ops.admit("s7", s7), ops.free("s6"),
               ops.append("s7", [13, 5]),  # a fifth block: s6's, offloaded
               ops.commit("s7", 18), ops.free("s7"),
               ops.admit("s17", [1, 2])]  # 1 token onboarded from host slot 0
    options = CacheOptions(host_blocks=24, state_interval=1)
    assert replay(LocalTarget(kvcache.load()), op_list, 5, B, options) == []


def test_of_two_equal_copy_sources_the_oracle_copies_the_cache_s() -> None:
    """Fuzz seed 127 of 300 once a copy source's release ticked: s14 shares 2 tokens with
    s9's [6, 38, 31, 34] and s1's [6, 38, 24, 23], both followed. The cache copies from
    the first cached, s9's, which so outlives s1's when s17 evicts, and s20 claims 2
    tokens of it; the count oracle copied from the most recently cached, s1's, and
    predicted 3."""
    op_list = [ops.admit("s1", [6, 38, 24, 23, 33, 8]),
               ops.admit("s9", [6, 38, 31, 34, 19]), ops.commit("s9", 5), ops.free("s9"),
               ops.commit("s1", 6), ops.free("s1"),
               ops.admit("s11", [6, 38, 24, 23, 2, 31, 21, 37, 20], SALT),
               ops.admit("s12", [17]), *SEED_127_AFTER_S12]
    assert replay(LocalTarget(kvcache.load()), op_list, 16, B) == []

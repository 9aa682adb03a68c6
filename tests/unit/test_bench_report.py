"""benchmarks.report on synthetic pytest-benchmark JSON, and the quick suites end to end.

One test runs the report as its users run it, `python -m benchmarks.report` from the
repository root (benchmarks/ is not installed, so it is importable only from there); the
rest call its `main` in this process, which reads the same arguments and returns the same
exit status, without paying a fresh interpreter and matplotlib's import each. The quick
suites' run (about a minute) is post-merge.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.hang_guard import run_child

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def report_cli(*args: Path | str) -> subprocess.CompletedProcess[str]:
    """Run `python -m benchmarks.report ARGS` from the repository root."""
    return run_child([sys.executable, "-m", "benchmarks.report", *map(str, args)], cwd=REPO)


def report(*args: Path | str) -> subprocess.CompletedProcess[str]:
    """`benchmarks.report.main(ARGS)` in this process: its exit status and what it printed,
    as `report_cli` returns them."""
    from benchmarks.report import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in args])
    return subprocess.CompletedProcess(["benchmarks.report", *map(str, args)], code,
                                       out.getvalue(), err.getvalue())


def bench(name: str, median: float, extra: dict[str, Any], minimum: float | None = None,
          rounds: int = 5) -> dict[str, Any]:
    """One benchmark entry shaped as pytest-benchmark writes it."""
    low = median if minimum is None else minimum
    return {"name": name, "fullname": f"benchmarks/x.py::{name}", "group": None,
            "params": None, "extra_info": extra,
            "stats": {"min": low, "max": median * 2, "mean": median, "median": median,
                      "rounds": rounds, "stddev": 0.0, "iterations": 1}}


def ttft(cached: int, engine_s: float, ideal_s: float, headline: bool) -> dict[str, Any]:
    return bench(f"test_ttft[c{cached}]", engine_s, {
        "suite": "ttft", "prompt_tokens": 2048, "cached_tokens": cached,
        "cached_fraction": cached / 2048, "headline": headline, "ideal_median_s": ideal_s})


def suite_benches() -> list[dict[str, Any]]:
    """One or more entries for every section of the summary, plus an unknown one."""
    core = {"workload": "shared_prompt", "phase": "insert", "tokens": 100_000_000,
            "baseline_tokens_per_s": 5e7, "target_tokens_per_s": 1e8,
            "arrays_tokens_per_s": 4.5e8}
    return [
        bench("test_cache_core_throughput[shared_prompt-insert]", 0.6, core, minimum=0.5),
        bench("test_request_cost_is_flat_in_tree_size[1e3]", 20e-6, {"cached_blocks": 1000}),
        bench("test_request_cost_is_flat_in_tree_size[1e6]", 30e-6,
              {"cached_blocks": 1_000_000}),
        bench("test_build_decode_metadata[b256]", 12e-6, {"batch": 256, "context": 4096,
                                                           "baseline_us": 4.0, "ratio": 3.0}),
        bench("test_copy_kv_indices_baseline[b256]", 4e-6, {"batch": 256}),
        bench("test_decode_step_metadata[b64-ragged]", 160e-6, {
            "batch": 64, "ragged": True, "context": 4096, "steps_per_round": 16,
            "baseline_us": 2.0, "step_us": 10.0, "ratio": 5.0, "rebuild_us": 30.0}),
        bench("test_reference_attention", 0.02, {"ratio": 1.7}),
        ttft(0, 0.42, 0.40, False), ttft(1536, 0.105, 0.1, True),
        bench("test_hit_rate_curve[multi_turn]", 0.01, {
            "suite": "hit_rate", "workload": "multi_turn", "requests": 576, "batch": 8,
            "pool_blocks": [700, 7000], "pool_fraction": [0.1, 1.0],
            "block_hit_rate": [0.3156, 0.9156], "token_hit_rate": [0.3156, 0.9145],
            "evicted_blocks": [23552, 0], "max_token_hit_rate": 0.9145}),
        bench("test_heap_per_cached_block[shared_prompt]", 0.5, {
            "suite": "memory", "kind": "heap", "workload": "shared_prompt",
            "cached_blocks": 32960, "bytes_per_cached_block": 89.08,
            "bytes_per_cached_token": 5.567, "bytes_per_pool_block": 39.95,
            "heap_to_tiny_fp16_kv": 0.00272}),
        bench("test_kv_bytes_per_token[fp16]", 1e-4, {
            "suite": "memory", "kind": "kv", "dtype": "float16", "bytes_per_token": 2048.0,
            "bytes_per_block": 32768.0}),
        bench("test_flashinfer_decode_throughput[b64-kv4096-fa2]", 1e-4, {
            "suite": "gpu_attention", "phase": "decode", "requests": 64, "cached": 4095,
            "new": 1, "kernel_family": "fa2", "kernels": {"prefill": None, "decode": "fa2"},
            "seconds_per_call": 1e-4, "tokens_per_s": 6.4e5, "bytes_per_s": 3.4e12,
            "tflops": 1.5, "ratio_to_copy_bandwidth": 0.8, "device": "NVIDIA H200"}),
        bench("test_decode_step[eager-b8]", 2e-3, {"suite": "gpu_decode_step", "mode": "eager",
                                                   "batch": 8, "device": "NVIDIA H200"}),
        bench("test_decode_step[graph-b8]", 1e-3, {"suite": "gpu_decode_step", "mode": "graph",
                                                   "batch": 8, "device": "NVIDIA H200"}),
        *layouts(),
        bench("test_decode_step[b64]", 0.1, {
            "suite": "step", "kind": "decode", "model": "tiny", "batch": 64, "context": 128,
            "step_us": 100000.0,
            "phase_us": {"schedule": 50.0, "metadata": 250.0, "plan": 60.0,
                         "forward": 99300.0, "sample": 240.0, "commit": 100.0},
            "overhead_fraction": 0.007, "target": 0.1}),
        bench("test_prefill_step", 0.03, {
            "suite": "step", "kind": "prefill", "batch": 4, "prompt_tokens": 768,
            "budget": 512, "step_us": 30000.0,
            "phase_us": {"schedule": 90.0, "metadata": 300.0, "plan": 50.0,
                         "forward": 29400.0, "sample": 60.0, "commit": 100.0},
            "overhead_fraction": 0.02, "target": None}),
        bench("test_window_long_prompt", 0.2, {
            "suite": "window", "model": "tiny-swa", "window": 32, "prompt_tokens": 2048,
            "chunk_tokens": 256, "block_size": 16, "pool_blocks_release": 19,
            "pool_blocks_keep": 129, "kv_bytes_release": 19 << 16, "kv_bytes_keep": 129 << 16,
            "most_used_release": 18, "most_used_keep": 128, "keep_median_s": 0.5,
            "keep_over_release": 2.5}),
        *host_tier(),
        bench("test_something_new", 0.25, {}),
    ]


def host_tier() -> list[dict[str, Any]]:
    """One benchmark of each host-tier suite."""
    return [
        bench("test_hit_rate_with_a_host_tier[multi_turn]", 0.03, {
            "suite": "host_tier_hit_rate", "workload": "multi_turn", "requests": 144,
            "batch": 8, "host_factor": 4, "pool_blocks": [704, 1800],
            "pool_fraction": [0.3911, 1.0], "block_hit_rate": [0.3689, 0.9022],
            "block_hit_rate_host": [0.89, 0.9022], "onboarded_blocks": [3752, 0],
            "offloaded_blocks": [4824, 0], "dropped_blocks": [17, 0]}),
        bench("test_ttft_with_a_host_tier[pool0.25]", 0.7, {
            "suite": "host_tier_ttft", "model": "tiny", "host_factor": 4, "chats": 6,
            "turns": 4, "pool_blocks": 13, "pool_fraction": 0.27, "mean_ttft_s": 0.02,
            "mean_ttft_host_s": 0.015, "hit_rate": 0.3, "hit_rate_host": 0.6,
            "onboarded_blocks": 33}),
        bench("test_onboard_against_recompute[32]", 0.025, {
            "suite": "host_tier_onboard", "host_factor": 4, "blocks": 32, "tokens": 512,
            "device_ttft_s": 0.015, "cold_ttft_s": 0.165, "onboard_s": 0.01,
            "recompute_s": 0.15, "recompute_over_onboard": 15.0, "copy_s": 0.002}),
    ]


def layouts() -> list[dict[str, Any]]:
    """The layouts suite at batch 64: BLHNC's metadata build, its copies and NHD's."""
    common = {"suite": "layouts", "batch": 64, "layers": 16, "block_size": 64,
              "page_size": 16, "context": 4096}
    return [
        bench("test_layout_metadata_build[blhnc-b64]", 60e-6, common | {
            "kind": "metadata", "layout": "BLHNC", "multiplier": 128,
            "ratio_to_index_copy": 20.0}, minimum=50e-6),
        bench("test_layout_block_copies[blhnc-b64]", 3e-3, common | {
            "kind": "copies", "layout": "BLHNC", "tensors": 2, "ratio_to_index_copy": 500.0,
            "ratio_to_memcpy": 8.0}, minimum=2e-3),
        bench("test_layout_block_copies[nhd-b64]", 40e-3, common | {
            "kind": "copies", "layout": "NHD", "tensors": 32, "ratio_to_index_copy": 8000.0,
            "ratio_to_memcpy": 120.0}, minimum=30e-3),
    ]


def write_json(path: Path, benches: list[dict[str, Any]], libraries: bool = True) -> Path:
    machine: dict[str, Any] = {"node": "vm", "python_version": "3.11.7", "system": "Linux",
                               "cpu": {"brand_raw": "AMD EPYC", "count": 2},
                               "torch_num_threads": 1, "bench_quick": False}
    if libraries:
        machine["libraries"] = {"torch": "9.9.9-synthetic", "flashinfer-python": "0.7.4"}
    path.write_text(json.dumps({"machine_info": machine, "benchmarks": benches,
                                "commit_info": {"id": "abcdef1234567890", "branch": "main"},
                                "datetime": "2026-01-01T00:00:00", "version": "5.2.3"}))
    return path


def test_summary_has_headline_numbers_and_plots(tmp_path: Path) -> None:
    src = write_json(tmp_path / "bench.json", suite_benches())
    out = tmp_path / "out"
    proc = report_cli(out, "--json", src)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(out / name) for name in (
        "summary.md", "ttft_vs_cached_fraction.png", "hit_rate_vs_pool_size.png",
        "cost_vs_tree_size.png")]
    md = (out / "summary.md").read_text()
    for text in ("200.0 Mtok/s", "50.0 Mtok/s", "| 4.00x |", "| 2.00x |",  # cache core
                 "| 450.0 Mtok/s |",
                 "Largest tree / smallest: 1.50x",
                 "| rebuild | 256 | no | 4096 | 12 us | 4 us | 3.00x |  |",  # metadata
                 "| step | 64 | yes | 4096 | 10 us | 2 us | 5.00x | 30 us |",
                 "warm / ideal: **1.05x**", "cold / warm: **4.00x**", "new tokens: 4.00x",
                 "| 0.3156 |", "| 23552 |", "| 89.08 |", "| float16 | 2048.0 |",
                 "| 8 | 2 ms | 1 ms | 2.00x |", "NVIDIA H200",  # GPU decode step
                 "| decode | 64 x (4095 + 1) | fa2 (fa2) | 100 us |",  # GPU attention
                 "| BLHNC | 64 | 128 | 50 us | 20.00x | 2 | 2 ms | 500.00x | 8.00x |",
                 "| NHD | 64 | n/a | n/a | n/a | 32 | 30 ms | 8000.00x | 120.00x |",
                 "batch 64: packed block copies 15.00x faster",  # storage layouts
                 "| decode (tiny) | 64 | 128-token contexts | 100 ms | 50 us | 250 us | 60 us | 99.3 ms "
                 "| 240 us | 100 us | 0.7% |", "decode batch 64: **0.7%** of the step (target <= 10%)",
                 "| prefill | 4 | 768-token prompts, 512 a step | 30 ms |",  # step overhead
                 "| release | 19 | 1.19 | 18 | 200 ms |", "6.79x less with release",
                 "## Host tier (4x the device pool)", "| 704 | 0.3911 | 0.3689 | 0.89 | 3752 | "
                 "4824 | 17 |", "| 13 | 0.27 | 20 ms | 15 ms | 0.75x | 0.3 | 0.6 | 33 |",
                 "| 32 | 512 | 15 ms | 25 ms | 165 ms | 10 ms | 150 ms | 15.00x | 2 ms |",
                 "test_something_new", "torch 9.9.9-synthetic", "commit abcdef123456"):
        assert text in md, f"{text!r} missing from summary.md:\n{md}"
    for png in ("ttft_vs_cached_fraction.png", "hit_rate_vs_pool_size.png",
                "cost_vs_tree_size.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC, png
        assert f"]({png})" in md


def test_reads_only_benchmark_json_from_the_folder(tmp_path: Path) -> None:
    write_json(tmp_path / "bench.json", suite_benches()[:1])
    (tmp_path / "reuse_report.json").write_text(json.dumps({"records": []}))
    assert report(tmp_path).returncode == 0
    md = (tmp_path / "summary.md").read_text()
    assert "sources: bench.json" in md
    assert "## Time to first token" not in md  # sections without benchmarks are left out
    assert not (tmp_path / "ttft_vs_cached_fraction.png").exists()


def test_a_given_file_that_is_not_benchmark_json_is_an_error(tmp_path: Path) -> None:
    other = tmp_path / "reuse_report.json"
    other.write_text(json.dumps({"records": []}))
    proc = report(tmp_path, "--json", other)
    assert proc.returncode == 2
    assert f"{other}: not pytest-benchmark JSON" in proc.stderr
    assert not (tmp_path / "summary.md").exists()


def test_a_benchmark_json_of_the_wrong_shape_is_an_error_not_rendered(tmp_path: Path) -> None:
    good = write_json(tmp_path / "a.json", suite_benches()[:1])
    broken = suite_benches()[:2]
    del broken[1]["stats"]["median"]
    bad = write_json(tmp_path / "b.json", broken)
    for args in ((tmp_path,), (tmp_path, "--json", good, "--json", bad)):
        proc = report(*args)
        assert proc.returncode == 2
        assert f"{bad}: benchmarks[1] (test_request_cost_is_flat_in_tree_size[1e3]): stats " \
               "lack ['median']" in proc.stderr
        assert not (tmp_path / "summary.md").exists()


def test_a_folder_without_benchmark_json_is_an_error(tmp_path: Path) -> None:
    proc = report(tmp_path)
    assert proc.returncode == 2
    assert f"no pytest-benchmark JSON found in {tmp_path}/*.json" in proc.stderr


def test_unreadable_extra_info_is_reported_not_raised(tmp_path: Path) -> None:
    old = bench("test_ttft[c0]", 0.4, {"suite": "ttft", "prompt_tokens": 2048,
                                         "cached_fraction": 0.0})
    write_json(tmp_path / "bench.json", [old], libraries=False)
    assert report(tmp_path).returncode == 0
    md = (tmp_path / "summary.md").read_text()
    assert "Not rendered: KeyError: 'cached_tokens' while reading test_ttft[c0]" in md
    assert "TTFT against cached fraction: not drawn" in md
    assert "libraries (read when the report was written)" in md


def test_table_cells_are_escaped(tmp_path: Path) -> None:
    """A name with `|` or a backtick stays in its cell (the tables went unescaped)."""
    write_json(tmp_path / "bench.json", [bench("test_other[a|b-`c`]", 0.002, {})])
    assert report(tmp_path).returncode == 0
    md = (tmp_path / "summary.md").read_text()
    assert "| test_other[a\\|b-\\`c\\`] | 2 ms | 5 |" in md.splitlines()


def test_every_suite_declares_its_own_sections() -> None:
    """A suite's part of the summary lives in its own file: every benchmarks/test_bench_*.py
    declares SECTIONS (its renderers beside its benchmarks), no two sections share a
    title, and the summary renders those (report_md.py held them all, apart from the
    suites)."""
    from benchmarks.report import SUITES, sections
    from benchmarks.report_format import Section

    declared = []
    for path in sorted(SUITES.glob("test_bench_*.py")):
        suite = importlib.import_module(f"benchmarks.{path.stem}")
        assert suite.SECTIONS and all(isinstance(s, Section) for s in suite.SECTIONS), path.name
        declared += suite.SECTIONS
    assert list(sections()) == declared
    titles = [s.title for s in declared]
    assert len(titles) == len(set(titles)) and "Decode metadata" in titles


@pytest.mark.slow
def test_quick_suites_end_to_end(tmp_path: Path) -> None:
    """The quick suites run under pytest-benchmark and the report reads what they wrote."""
    out = tmp_path / "bench"
    out.mkdir()
    suites = ["benchmarks/test_bench_engine.py", "benchmarks/test_bench_hit_rate.py",
              "benchmarks/test_bench_memory.py", "benchmarks/test_bench_routing.py",
              "benchmarks/test_bench_step.py", "benchmarks/test_bench_metadata.py",
              "benchmarks/test_bench_window.py", "benchmarks/test_bench_host_tier.py"]
    proc = run_child(
        [sys.executable, "-m", "pytest", *suites, "--bench-quick", "-q", "-p",
         "no:cacheprovider", f"--benchmark-json={out / 'bench.json'}"], cwd=REPO,
        # under xdist the worker's PYTEST_XDIST_* variables would switch benchmarks off
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report_cli(out).returncode == 0
    md = (out / "summary.md").read_text()
    for title in ("## Time to first token", "## Hit rate against pool size", "## Memory",
                  "## Cache-aware routing", "## Step overhead", "## Decode metadata",
                  "## Sliding window", "## Host tier", "quick mode: True"):
        assert title in md, f"{title!r} missing from summary.md:\n{md}"
    assert "Not rendered" not in md and "not drawn" not in md, md
    assert (out / "hit_rate_vs_pool_size.png").read_bytes()[:8] == PNG_MAGIC

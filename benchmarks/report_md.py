"""Markdown sections of the benchmark summary, one per suite.

Each `Section` claims the benchmarks it renders (by test name or extra_info["suite"]);
`benchmarks.report` renders every section that claimed something and lists the rest
under "Other benchmarks". Times in the JSON are seconds per round.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from benchmarks.report_format import (
    Section,
    div,
    duration,
    rate,
    ratio,
    table,
)

if TYPE_CHECKING:
    from harness.reports.bench_results import Benchmark

METADATA_TARGET = 4.0  # issues 3, 17: decode metadata costs at most 4 copy_'s
WARM_TARGET = 1.05  # issue 3: warm TTFT within 5% of the ideal
STEP_PHASES = ("schedule", "metadata", "plan", "forward", "sample", "commit")


def _bases(*names: str) -> Callable[[Benchmark], bool]:
    return lambda b: b.base in names


def _suite(prefix: str) -> Callable[[Benchmark], bool]:
    return lambda b: str(b.extra.get("suite", "")).startswith(prefix)


def _cache_core(benches: Sequence[Benchmark]) -> list[str]:
    rows = []
    for b in sorted(benches, key=lambda b: (b.extra.get("workload", ""), b.name)):
        e = b.extra
        ours = e.get("tokens_per_s") or div(e.get("tokens"), b.min)
        base, target = e.get("baseline_tokens_per_s"), e.get("target_tokens_per_s")
        rows.append([e.get("workload", b.name), e.get("phase", "?"), rate(ours, "tok/s"),
                     rate(base, "tok/s"), ratio(div(ours, base)), rate(target, "tok/s"),
                     ratio(div(ours, target)), rate(e.get("arrays_tokens_per_s"), "tok/s")])
    return ["## Cache core: design workloads (best round)", "",
            "Fed Python lists, as the trie is; the last column feeds ours the same prompts "
            "as `array('I')` (no conversion).", "",
            *table(["workload", "phase", "ours", "baseline trie", "ours / baseline", "target",
                    "ours / target", "ours, fed array('I')"], rows)]


def _tree_size(benches: Sequence[Benchmark]) -> list[str]:
    ordered = sorted(benches, key=lambda b: b.extra.get("cached_blocks", 0))
    first = ordered[0].median
    rows = [[b.extra.get("cached_blocks", "?"), b.extra.get("tree_nodes", "?"),
             duration(b.median), ratio(b.median / first)] for b in ordered]
    return ["## Per-request cost against cached blocks (flat = O(prompt), not O(pool))", "",
            *table(["cached blocks", "tree nodes", "median per request", "vs smallest"], rows),
            f"Largest tree / smallest: {ratio(ordered[-1].median / first)}.", ""]


def _metadata(benches: Sequence[Benchmark]) -> list[str]:
    rows = []
    for b in sorted(benches, key=lambda b: (not b.base.startswith("test_decode_step"),
                                            b.extra.get("ragged", False), b.extra.get("batch", 0))):
        if b.base == "test_copy_kv_indices_baseline":
            continue
        e = b.extra
        per_step = b.median / e.get("steps_per_round", 1)  # seconds per step (or build)
        path = e.get("mode") or ("step" if b.base.startswith("test_decode_step") else "rebuild")
        if e.get("window"):
            path += f", window {e['window']}"
        rows.append([path, e.get("batch", "?"), "yes" if e.get("ragged") else "no",
                     e.get("context", "?"), duration(per_step),
                     duration(div(e.get("baseline_us"), 1e6)),
                     ratio(div(per_step * 1e6, e.get("baseline_us")) or e.get("ratio")),
                     duration(div(e.get("rebuild_us"), 1e6)) if "rebuild_us" in e else ""])
    return [f"## Decode metadata against one copy_ of kv_indices (target <= "
            f"{METADATA_TARGET:g}x)", "",
            "step: a PersistentBatch's decode step (what the engine runs; page starts "
            "included, per step of a page cycle), and the step after a request leaves and "
            "another joins; rebuild: build_metadata from the block table (the reference). "
            "Window rows: each request also releases its first block once per page cycle "
            "(the table's drop_front, plus the batch's release_front in step).",
            "", *table(["path", "batch", "ragged", "context", "time", "copy_", "time / copy_",
                        "after leave + join"], rows)]


def _layouts(benches: Sequence[Benchmark]) -> list[str]:
    by = {(b.extra["kind"], b.extra["layout"], int(b.extra["batch"])): b for b in benches}
    e = benches[0].extra
    lines = [f"## Storage layouts: metadata build and block copies ({e['layers']} layers, "
             f"blocks of {e['block_size']} read as pages of {e['page_size']}, "
             f"{e['context']}-token decode)", "",
             "Best of rounds (on a shared machine the least disturbed figure), against the "
             "best of one copy_ of the step's kv_indices (metadata, copies) and of one copy_ "
             "of the bytes the copies move (memcpy), timed in the same run.", ""]
    order = {"NHD": 0, "HND": 1, "BLHNC": 2}
    rows = []
    for layout, batch in sorted({k[1:] for k in by}, key=lambda k: (k[1], order.get(k[0], 3))):
        meta, copies = by.get(("metadata", layout, batch)), by.get(("copies", layout, batch))
        row: list[Any] = [layout, batch]
        row += ([meta.extra.get("multiplier", "?"), duration(meta.min),
                 ratio(meta.extra.get("ratio_to_index_copy"))] if meta else ["n/a"] * 3)
        row += ([copies.extra.get("tensors", "?"), duration(copies.min),
                 ratio(copies.extra.get("ratio_to_index_copy")),
                 ratio(copies.extra.get("ratio_to_memcpy"))] if copies else ["n/a"] * 4)
        rows.append(row)
    lines += table(["layout", "batch", "page multiplier", "metadata build", "build / copy_",
                    "tensors copied", "block copies", "copies / copy_", "copies / memcpy"],
                   rows)
    for batch in sorted({k[2] for k in by}):
        packed = by.get(("copies", "BLHNC", batch))
        per_layer = [b.min for b in (by.get(("copies", layout, batch)) for layout in
                                     ("NHD", "HND")) if b is not None]
        if packed is not None and per_layer:
            lines.append(f"- batch {batch}: packed block copies {ratio(min(per_layer) / packed.min)}"
                         f" faster than the fastest per-layer layout")
    return [*lines, ""]


def _attention(benches: Sequence[Benchmark]) -> list[str]:
    rows = [[b.name, duration(b.median), ratio(b.extra.get("ratio"))]
            for b in benches if b.base == "test_reference_attention"]
    rows += [[b.name, duration(b.median), "1.00x"]
             for b in benches if b.base == "test_dense_attention_baseline"]
    return ["## Reference paged attention against dense attention", "",
            *table(["benchmark", "median", "vs dense"], rows)]


def _ttft(benches: Sequence[Benchmark]) -> list[str]:
    by = {int(b.extra["cached_tokens"]): b for b in benches}
    L = int(benches[0].extra["prompt_tokens"])
    lines = [f"## Time to first token: tiny model, {L}-token prompt (median of rounds)", "",
             "The ideal (bare forward of the new tokens over a filled paged cache) is timed "
             "alternately with the engine, so engine / ideal is an in-run ratio.", ""]
    head = next((c for c, b in by.items() if b.extra.get("headline")), None)
    if head is not None and 0 in by:
        warm, cold = by[head], by[0]
        ideal, ideal_cold = warm.extra["ideal_median_s"], cold.extra["ideal_median_s"]
        lines += [f"Headline, {head} of {L} tokens cached: warm {duration(warm.median)}, cold "
                  f"{duration(cold.median)}, ideal {duration(ideal)}.", "",
                  f"- warm / ideal: **{ratio(warm.median / ideal)}** "
                  f"(target <= {WARM_TARGET:g}x)",
                  f"- cold / warm: **{ratio(cold.median / warm.median)}**; the ideal's cold / "
                  f"warm (the ratio of work): {ratio(ideal_cold / ideal)}; new tokens: "
                  f"{ratio(L / (L - head))}", ""]
    rows = [[c, f"{c / L:.3f}", duration(b.median), duration(b.extra.get("ideal_median_s")),
             ratio(div(b.median, b.extra.get("ideal_median_s")))]
            for c, b in sorted(by.items())]
    return lines + table(["cached tokens", "fraction", "engine", "ideal", "engine / ideal"],
                         rows)


def _hit_rate(benches: Sequence[Benchmark]) -> list[str]:
    lines = ["## Hit rate against pool size (engine-like replay, priority-LRU eviction)", ""]
    for b in sorted(benches, key=lambda b: b.extra.get("workload", "")):
        e = b.extra
        rows = zip(e.get("pool_blocks", []), e.get("pool_fraction", []),
                   e.get("block_hit_rate", []), e.get("token_hit_rate", []),
                   e.get("evicted_blocks", []), strict=False)
        lines += [f"**{e.get('workload', b.name)}**: {e.get('requests', '?')} requests in "
                  f"steps of {e.get('batch', '?')}; no-eviction hit rate "
                  f"{e.get('max_token_hit_rate', '?')}; replay at the smallest pool "
                  f"{duration(b.median)}.", "",
                  *table(["pool blocks", "of footprint", "block hit rate", "token hit rate",
                          "evicted blocks"], [list(r) for r in rows])]
    return lines


def _host_tier(benches: Sequence[Benchmark]) -> list[str]:
    by: dict[str, list[Benchmark]] = defaultdict(list)
    for b in benches:
        by[str(b.extra["suite"])].append(b)
    factor = benches[0].extra.get("host_factor", "?")
    lines = [f"## Host tier ({factor}x the device pool)", ""]
    for b in sorted(by["host_tier_hit_rate"], key=lambda b: b.extra.get("workload", "")):
        e = b.extra
        rows = zip(e["pool_blocks"], e["pool_fraction"], e["block_hit_rate"],
                   e["block_hit_rate_host"], e["onboarded_blocks"], e["offloaded_blocks"],
                   e["dropped_blocks"], strict=True)
        lines += [f"**Hit rate, {e['workload']}**: {e.get('requests', '?')} requests in steps "
                  f"of {e.get('batch', '?')}; replay at the smallest pool with the host tier "
                  f"{duration(b.median)}.", "",
                  *table(["pool blocks", "of footprint", "block hit rate", "with host tier",
                          "onboarded", "offloaded", "dropped"], [list(r) for r in rows])]
    ttft = sorted(by["host_tier_ttft"], key=lambda b: b.extra["pool_blocks"])
    if ttft:
        e = ttft[0].extra
        lines += [f"**TTFT, multi-turn chats** on the {e.get('model', '?')} model: "
                  f"{e.get('chats', '?')} chats of {e.get('turns', '?')} turns, turn-major, "
                  "one request at a time; mean time to first token.", "",
                  *table(["pool blocks", "of footprint", "TTFT", "with host tier",
                          "with / without", "hit rate", "with host tier", "onboarded"],
                         [[b.extra["pool_blocks"], b.extra["pool_fraction"],
                           duration(b.extra["mean_ttft_s"]),
                           duration(b.extra["mean_ttft_host_s"]),
                           ratio(div(b.extra["mean_ttft_host_s"], b.extra["mean_ttft_s"])),
                           b.extra["hit_rate"], b.extra["hit_rate_host"],
                           b.extra["onboarded_blocks"]] for b in ttft])]
    onboard = sorted(by["host_tier_onboard"], key=lambda b: b.extra["blocks"])
    if onboard:
        lines += ["**An onboard against recomputing the same tokens**: TTFT of a prompt "
                  "whose first k blocks are on the device, on the host or nowhere (medians); "
                  "onboard = host - device, recompute = cold - device; copy = the bare "
                  "host-to-device copy of the k blocks.", "",
                  *table(["blocks", "tokens", "device", "host", "cold", "onboard",
                          "recompute", "recompute / onboard", "copy only"],
                         [[b.extra["blocks"], b.extra["tokens"],
                           duration(b.extra["device_ttft_s"]), duration(b.median),
                           duration(b.extra["cold_ttft_s"]), duration(b.extra.get("onboard_s")),
                           duration(b.extra.get("recompute_s")),
                           ratio(b.extra.get("recompute_over_onboard")),
                           duration(b.extra["copy_s"])] for b in onboard])]
    return lines


def _routing(benches: Sequence[Benchmark]) -> list[str]:
    lines = ["## Cache-aware routing (N replicas; hit rate (prefill tokens saved) per "
             "router, load imbalance of the prefix routers)", ""]
    for b in sorted(benches, key=lambda b: b.extra.get("workload", "")):
        e = b.extra
        routers = e.get("routers", [])
        balancing = [r for r in routers if "prefix" in r]  # the cache-blind ones are even
        columns = [e.get("replicas", []), e.get("pool_blocks", []),
                   *([f"{rate:.3f} ({saved / 1e6:.2f} M)" for rate, saved in
                      zip(e.get(f"{r}_hit_rate", []), e.get(f"{r}_saved_tokens", []),
                          strict=False)] for r in routers),
                   *(e.get(f"{r}_imbalance", []) for r in balancing)]
        lines += [f"**{e.get('workload', b.name)}**: {e.get('requests', '?')} requests, "
                  f"{e.get('prompt_tokens', '?')} prompt tokens; each replica's pool holds "
                  f"{e.get('headroom', '?')} / N of the {e.get('footprint_blocks', '?')}-block "
                  "footprint.", "",
                  *table(["replicas", "pool blocks", *routers,
                          *(f"{r} imbalance" for r in balancing)],
                         [list(r) for r in zip(*columns, strict=False)])]
    return lines


def _hybrid(benches: Sequence[Benchmark]) -> list[str]:
    lines = ["## Hybrid model TTFT (recurrent-state snapshots)", ""]
    for b in benches:
        e = b.extra
        lines.append(f"{e.get('model')}, {e.get('prompt_tokens')}-token prompt with "
                     f"{e.get('cached_tokens')} cached: warm {duration(b.median)}, cold "
                     f"{duration(e.get('cold_median_s'))}, ideal "
                     f"{duration(e.get('ideal_median_s'))}; warm / ideal "
                     f"{ratio(e.get('warm_over_ideal'))}, cold / warm "
                     f"{ratio(e.get('cold_over_warm'))}; snapshots "
                     f"{e.get('snapshot_bytes')} bytes.")
    return [*lines, ""]


def _in_batch(benches: Sequence[Benchmark]) -> list[str]:
    lines = ["## In-batch prefix sharing (N siblings in one generate call, tiny model)", ""]
    rows = []
    for b in sorted(benches, key=lambda b: b.extra.get("siblings", 0)):
        e = b.extra
        done = e.get("computed_tokens", {})
        rows.append([e.get("siblings"), f"{e.get('prefix_tokens')} + {e.get('own_tokens')}",
                     duration(b.median), duration(e.get("separate_median_s")),
                     duration(e.get("ideal_median_s")), ratio(e.get("shared_over_ideal")),
                     ratio(e.get("separate_over_shared")),
                     f"{done.get('shared', '?')} / {done.get('separate', '?')}"])
    return lines + table(["N", "prefix + own tokens", "shared", "separate", "ideal",
                          "shared / ideal", "separate / shared",
                          "tokens computed shared / separate"], rows)


def _window(benches: Sequence[Benchmark]) -> list[str]:
    lines = ["## Sliding window: a long prompt with and without early release", ""]
    for b in benches:
        e = b.extra
        mib = 1 << 20
        rows = [["release", e["pool_blocks_release"], f"{e['kv_bytes_release'] / mib:.2f}",
                 e["most_used_release"], duration(b.median)],
                ["keep all", e["pool_blocks_keep"], f"{e['kv_bytes_keep'] / mib:.2f}",
                 e["most_used_keep"], duration(e["keep_median_s"])]]
        lines += [f"{e['model']} (window {e['window']}), {e['prompt_tokens']}-token prompt in "
                  f"{e['chunk_tokens']}-token chunks, blocks of {e['block_size']}:", "",
                  *table(["blocks", "pool (KV blocks)", "KV MiB", "most used", "TTFT"], rows),
                  f"KV memory: {ratio(div(e['kv_bytes_keep'], e['kv_bytes_release']))} less "
                  f"with release; TTFT keep / release: {ratio(e.get('keep_over_release'))}.",
                  ""]
    return lines


def _memory(benches: Sequence[Benchmark]) -> list[str]:
    heap = [b.extra for b in benches if b.extra.get("kind") == "heap"]
    kv = [b.extra for b in benches if b.extra.get("kind") == "kv"]
    lines = ["## Memory", ""]
    if heap:
        lines += ["Python heap of the manager (tracemalloc), design workloads:", "",
                  *table(["workload", "cached blocks", "bytes / cached block",
                          "bytes / cached token", "empty manager bytes / pool block",
                          "heap / tiny fp16 KV block"],
                         [[e.get("workload"), e.get("cached_blocks"),
                           e.get("bytes_per_cached_block"), e.get("bytes_per_cached_token"),
                           e.get("bytes_per_pool_block"), e.get("heap_to_tiny_fp16_kv")]
                          for e in heap])]
    if kv:
        lines += ["KV storage of the tiny model:", "",
                  *table(["dtype", "bytes / token", "bytes / block"],
                         [[e.get("dtype"), e.get("bytes_per_token"), e.get("bytes_per_block")]
                          for e in kv])]
    return lines


def _step(benches: Sequence[Benchmark]) -> list[str]:
    rows, lines = [], []
    for b in sorted(benches, key=lambda b: (b.extra["kind"] != "decode", b.extra["batch"],
                                            b.extra.get("model", ""))):
        e = b.extra
        phases = e["phase_us"]
        size = (f"{e['context']}-token contexts" if e["kind"] == "decode"
                else f"{e['prompt_tokens']}-token prompts, {e['budget']} a step")
        kind = f"{e['kind']} ({e['model']})" if "model" in e else e["kind"]
        rows.append([kind, e["batch"], size,
                     duration(e["step_us"] / 1e6),
                     *(duration(phases[p] / 1e6) for p in STEP_PHASES),
                     f"{e['overhead_fraction']:.1%}"])
        if e.get("target") is not None:
            lines.append(f"Not forward at decode batch {e['batch']}: **{e['overhead_fraction']:.1%}** "
                         f"of the step (target <= {e['target']:.0%}).")
    return ["## Step overhead: one engine step of the tiny model by phase (medians)", "",
            *table(["step", "batch", "size", "step", *STEP_PHASES, "not forward"], rows),
            *lines, ""]


def _gpu(benches: Sequence[Benchmark]) -> list[str]:
    groups: dict[str, list[Benchmark]] = defaultdict(list)
    for b in benches:
        groups[str(b.extra["suite"])].append(b)
    device = benches[0].extra.get("device", "?")
    lines = [f"## GPU ({device})", ""]
    rows = []
    for b in groups["gpu_attention"]:
        e = b.extra
        ran = e.get("kernels") or {}
        rows.append([e["phase"], f"{e['requests']} x ({e['cached']} + {e['new']})",
                     f"{e.get('kernel_family', '?')} ({ran.get(e['phase'], '?')})",
                     duration(e.get("seconds_per_call")), rate(e.get("tokens_per_s"), "tok/s"),
                     rate(e.get("bytes_per_s"), "B/s"), f"{e.get('tflops', 0):.1f}",
                     ratio(e.get("ratio_to_copy_bandwidth")), ratio(e.get("ratio_to_nominal_hbm"))])
    if rows:
        lines += table(["phase", "requests x (cached + new)", "family (ran)", "per call",
                        "throughput", "bandwidth", "TFLOP/s", "vs copy bandwidth",
                        "vs nominal HBM"], rows)
    ttft = {b.extra["path"]: b.median for b in groups["gpu_ttft"]}
    if {"warm", "cold"} <= ttft.keys():
        lines += [f"TTFT (tiny, fp16, FlashInfer): warm {duration(ttft['warm'])}, cold "
                  f"{duration(ttft['cold'])}, cold / warm {ratio(ttft['cold'] / ttft['warm'])}.",
                  ""]
    steps = {(b.extra["batch"], b.extra["mode"]): b.median for b in groups["gpu_decode_step"]}
    if steps:
        lines += table(["batch", "eager step", "graph step", "eager / graph"],
                       [[bs, duration(steps.get((bs, "eager"))),
                         duration(steps.get((bs, "graph"))),
                         ratio(div(steps.get((bs, "eager")), steps.get((bs, "graph"))))]
                        for bs in sorted({k[0] for k in steps})])
    return lines


def other_section(benches: Sequence[Benchmark]) -> list[str]:
    """Benchmarks no section claimed."""
    return ["## Other benchmarks", "",
            *table(["benchmark", "median", "rounds"],
                   [[b.name, duration(b.median), b.rounds] for b in benches])]


SECTIONS: tuple[Section, ...] = (
    Section("Cache core", _bases("test_cache_core_throughput"), _cache_core),
    Section("Per-request cost against cached blocks",
            _bases("test_request_cost_is_flat_in_tree_size"), _tree_size),
    Section("Decode metadata", _bases("test_decode_step_metadata",
                                      "test_decode_step_metadata_windowed",
                                      "test_build_decode_metadata",
                                      "test_build_decode_metadata_ragged",
                                      "test_copy_kv_indices_baseline"), _metadata),
    Section("Storage layouts", _suite("layouts"), _layouts),
    Section("Reference paged attention", _bases("test_reference_attention",
                                                "test_dense_attention_baseline"), _attention),
    Section("Time to first token", _suite("ttft"), _ttft),
    Section("Step overhead", _suite("step"), _step),
    Section("Hit rate against pool size", _suite("hit_rate"), _hit_rate),
    Section("Host tier", _suite("host_tier"), _host_tier),
    Section("Hybrid model TTFT", _suite("hybrid_ttft"), _hybrid),
    Section("In-batch prefix sharing", _suite("in_batch"), _in_batch),
    Section("Cache-aware routing", _suite("routing"), _routing),
    Section("Sliding window", _suite("window"), _window),
    Section("Memory", _suite("memory"), _memory),
    Section("GPU", _suite("gpu_"), _gpu),
)

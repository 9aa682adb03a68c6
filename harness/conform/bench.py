"""The cache-core benchmark workloads through each adapter, side by side, in one process.

The workloads and phases of `benchmarks/test_bench_cache_core.py` (docs/design.md,
"Benchmark workloads and targets"): shared_prompt, multi_turn and random_tree, each
`insert` (admit, commit, free every request in order on a fresh cache) and `match` (the
same on a cache that has seen every request once), 16-token blocks, a pool the
workload fits in. Each runs through the engine's adapter and through kvcache's, in the
engine's worker, so both pay the same protocol (no event log, no router events) on the
same interpreter at the same time. Tokens per second of the best round.

`python -m harness.conform.bench RESULTS_DIR` is `nox -s bench`'s section: the same
through every pinned engine already installed (skipped otherwise).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from harness.conform.protocol import CacheUnderTest, LoadedEngine
from harness.reports.markdown import table
from harness.workloads import CACHE_BENCH_WORKLOADS

BLOCK = 16
WORKLOADS = CACHE_BENCH_WORKLOADS
PHASES = ("insert", "match")
QUICK_PROMPTS = 100  # a quick run's prompts per workload


class BenchRow(NamedTuple):
    """One (workload, phase, adapter): tokens and the best round's seconds."""

    workload: str
    phase: str
    adapter: str
    tokens: int
    seconds: float
    tokens_per_s: float


def _run(cache: CacheUnderTest, prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        seq = str(i)
        if cache.admit(seq, p, None, None) is None:
            raise RuntimeError(f"bench: request {i} was refused: the pool is sized to fit")
        cache.commit(seq, len(p))
        cache.free(seq)


def _timed(make: Callable[[int], CacheUnderTest], pool: int, prompts: list[list[int]],
           phase: str, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        cache = make(pool)
        if phase == "match":
            _run(cache, prompts)
        start = time.perf_counter()
        _run(cache, prompts)
        best = min(best, time.perf_counter() - start)
    return best


def run_bench(engine: LoadedEngine | None, quick: bool) -> list[BenchRow]:
    """Every workload and phase through `engine`'s adapter (None: kvcache's only) and
    kvcache's. Raises RuntimeError if an adapter refuses a request."""
    from harness.conform.kvcache_adapter import KvcacheCache

    adapters: list[tuple[str, Callable[[int], CacheUnderTest]]] = [
        ("kvcache", lambda n: KvcacheCache(n, BLOCK, record=False))]
    if engine is not None:
        new = engine.new
        adapters.append((f"{engine.name} {engine.version}", lambda n: new(n, BLOCK, False)))
    rows = []
    for workload, build in WORKLOADS.items():
        prompts = build()[:QUICK_PROMPTS] if quick else build()
        tokens = sum(map(len, prompts))
        pool = sum(-(-len(p) // BLOCK) for p in prompts) + 64
        for phase in PHASES:
            for name, make in adapters:
                seconds = _timed(make, pool, prompts, phase, 1 if quick else 2)
                rows.append(BenchRow(workload, phase, name, tokens, seconds, tokens / seconds))
    return rows


PINNED = ("vllm==0.33.0", "sglang==0.5.23")


def section(results: Path, quick: bool, say: Callable[[str], None] = print) -> list[str]:
    """The speed comparison for `nox -s bench`: every pinned engine whose cached install
    exists runs `kvharness conform SPEC --bench` (its report under
    results/conformance-<engine>); returns the markdown section (a line saying none was
    installed otherwise). Installs nothing."""
    from harness.conform.install import installed  # harness side only, never in a worker
    from harness.conform.locks import UnsupportedVersion, find_lock
    from harness.conform.runner import conform

    lines = ["## Prefix caches side by side (kvharness conform --bench)", ""]
    ran = False
    for spec in PINNED:
        engine, version = spec.split("==")
        try:
            lock = find_lock(engine, version)
        except UnsupportedVersion as exc:  # none committed for this Python
            say(f"conformance bench: {spec} skipped: {exc}")
            continue
        if installed(lock) is None:
            say(f"conformance bench: {spec} is not installed; skipped "
                f"(kvharness conform {spec} installs it)")
            continue
        ran = True
        report = conform(spec, results / f"conformance-{engine}", seeds=0,
                         bench=not quick, bench_quick=quick, only=["cold_then_warm"], say=say)
        lines += [f"### {spec}", ""]
        lines += _speed_table(report.bench) if report.bench else [f"not run: {report.reason}"]
        lines.append("")
    if not ran:
        lines.append("skipped: no engine is installed (`kvharness conform vllm==0.33.0` "
                     "installs one)")
    return lines


def _speed_table(rows: list[dict[str, Any]]) -> list[str]:
    by: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        by.setdefault((r["workload"], r["phase"]), {})[r["adapter"].split()[0]] = \
            r["tokens_per_s"]
    engines = sorted({a for d in by.values() for a in d} - {"kvcache"})
    header = ("workload", "phase", "kvcache tokens/s", *(f"{e} tokens/s" for e in engines),
              *(f"kvcache / {e}" for e in engines))
    body = [(w, p, f"{d['kvcache']:.3g}", *(f"{d[e]:.3g}" for e in engines),
             *(f"{d['kvcache'] / d[e]:.1f}x" for e in engines)) for (w, p), d in by.items()]
    return table(header, body)


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.conform.bench RESULTS_DIR [--quick]`: write
    RESULTS_DIR/conformance.md (see `section`)."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m harness.conform.bench RESULTS_DIR [--quick]", file=sys.stderr)
        return 2
    results = Path(args[0])
    lines = section(results, "--quick" in args[1:])
    results.mkdir(parents=True, exist_ok=True)
    (results / "conformance.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

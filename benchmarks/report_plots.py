"""PNG plots of the benchmark summary, drawn with matplotlib's Agg canvas (no pyplot, no
global backend state): TTFT against cached fraction, hit rate against pool size,
per-request cost against tree size. A plot whose benchmarks did not run is not drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from benchmarks.report_format import RENDER_ERRORS

if TYPE_CHECKING:
    from harness.reports.bench_results import Benchmark


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def ttft_plot(benches: Sequence[Benchmark]) -> Figure | None:
    """Engine and ideal TTFT (median, ms) against the cached fraction of the prompt."""
    points = [b for b in benches if b.extra.get("suite") == "ttft"]
    if not points:
        return None
    L = points[0].extra.get("prompt_tokens", "?")
    fig, ax = _figure(f"Time to first token, tiny model, {L}-token prompt",
                      "cached fraction of the prompt", "TTFT, median (ms, log)")
    points.sort(key=lambda b: b.extra["cached_fraction"])
    x = [b.extra["cached_fraction"] for b in points]
    ax.plot(x, [b.median * 1e3 for b in points], "o-", label="engine")
    ax.plot(x, [b.extra["ideal_median_s"] * 1e3 for b in points], "s--", label="ideal")
    ax.set_yscale("log")
    ax.legend()
    return fig


def hit_rate_plot(benches: Sequence[Benchmark]) -> Figure | None:
    """Block hit rate against pool size (as a fraction of the no-eviction footprint)."""
    curves = [b for b in benches if b.extra.get("suite") == "hit_rate"]
    if not curves:
        return None
    fig, ax = _figure("Hit rate against pool size (priority-LRU)",
                      "pool size / no-eviction footprint (log)", "block hit rate")
    for b in sorted(curves, key=lambda b: str(b.extra.get("workload"))):
        ax.plot(b.extra["pool_fraction"], b.extra["block_hit_rate"], "o-",
                label=str(b.extra.get("workload", b.name)))
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.legend()
    return fig


def tree_size_plot(benches: Sequence[Benchmark]) -> Figure | None:
    """Median cost of one request against the number of cached blocks."""
    points = sorted((b.extra["cached_blocks"], b.median * 1e6) for b in benches
                    if b.base == "test_request_cost_is_flat_in_tree_size"
                    and "cached_blocks" in b.extra)
    if not points:
        return None
    fig, ax = _figure("Per-request cost against tree size (2,048-token request)",
                      "cached blocks (log)", "median per request (us)")
    ax.plot(*zip(*points, strict=True), "o-")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    return fig


PLOTS: tuple[tuple[str, str, Callable[[Sequence[Benchmark]], Figure | None]], ...] = (
    ("TTFT against cached fraction", "ttft_vs_cached_fraction.png", ttft_plot),
    ("Hit rate against pool size", "hit_rate_vs_pool_size.png", hit_rate_plot),
    ("Per-request cost against tree size", "cost_vs_tree_size.png", tree_size_plot),
)


class PlotsWritten(NamedTuple):
    """Plots drawn (title -> PNG path) and one line per plot that could not be drawn."""

    paths: dict[str, Path]
    problems: list[str]


def write_plots(benches: Sequence[Benchmark], out_dir: Path) -> PlotsWritten:
    """Draw every plot that has data into `out_dir` (writes PNG files)."""
    out = PlotsWritten({}, [])
    for title, filename, draw in PLOTS:
        try:
            fig = draw(benches)
        except RENDER_ERRORS as exc:
            out.problems.append(f"{title}: not drawn ({type(exc).__name__}: {exc})")
            continue
        if fig is None:
            continue
        path = out_dir / filename
        fig.savefig(path, dpi=120)
        out.paths[title] = path
    return out

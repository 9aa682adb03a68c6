"""The GPU check's stages, in the order they run: cheapest and most telling first.

Each stage is one pytest process over GPU tests (tests/gpu, benchmarks/test_bench_gpu.py),
so a crash or a hung kernel ends one stage, not the check. The order: does the
environment work at all; is FlashInfer right in fp16; are CUDA-graph replays right on
both decode kernels; does the engine with graphs equal it without; then bf16, sliding
window and soft cap, and the benchmarks with whatever time is left.
"""

from __future__ import annotations

from dataclasses import dataclass

FI = "tests/gpu/test_flashinfer_gpu.py"
REFERENCE_TESTS = (f"{FI}::test_matches_reference", f"{FI}::test_long_prefill_after_unaligned_prefix",
                   f"{FI}::test_chunked_prefill_matches_reference")


@dataclass(frozen=True)
class Stage:
    """One pytest run: `targets` (node ids), narrowed by `keyword` (-k) when set, with
    `extra_args` ("{results}" becomes the results folder); skipped with a reason when
    one of the `requires` modules is not importable."""

    name: str
    title: str
    targets: tuple[str, ...]
    keyword: str | None = None
    extra_args: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()


STAGES: tuple[Stage, ...] = (
    Stage("smoke", "environment: versions, one decode plan and forward",
          ("tests/gpu/test_gpu_smoke.py",)),
    Stage("reference-fp16", "FlashInfer against the reference, fp16: prefill and decode, "
          "NHD/HND, re-paged, non-aligned prefixes, long and chunked prefills, pinned families",
          (*REFERENCE_TESTS, f"{FI}::test_plans_run_the_pinned_kernel_family"),
          keyword="not bf16"),
    Stage("cuda-graphs", "CUDA-graph replay on both decode kernels after page-count changes, "
          "long-context padding", ("tests/gpu/test_graphs_gpu.py",)),
    # The other families' engine runs are in the lists: here each would compile the tiny
    # model's head_dim-64 kernels once more.
    Stage("engine", "engine with CUDA graphs against without: tokens and logits",
          ("tests/gpu/test_engine_gpu.py",), keyword="auto or one_token"),
    Stage("bf16", "FlashInfer against the reference, bf16; padded eager decode",
          (*REFERENCE_TESTS, f"{FI}::test_padded_eager_decode_matches_reference"),
          keyword="bf16 or padded_eager"),
    Stage("window-softcap", "sliding window (released blocks too), windowed and full "
          "layers in one step, and logits soft cap against the reference; the mixed-window "
          "engine with graphs against without",
          (f"{FI}::test_window_and_soft_cap_match_reference",
           f"{FI}::test_released_blocks_match_reference",
           f"{FI}::test_layer_windows_match_reference",
           "tests/gpu/test_engine_gpu.py::test_mixed_windows_graphs_on_equal_graphs_off")),
    Stage("benchmarks", "GPU benchmarks (quick): attention throughput, TTFT, graph decode",
          ("benchmarks/test_bench_gpu.py",),
          extra_args=("--bench-quick", "--benchmark-json={results}/bench.json"),
          requires=("pytest_benchmark", "tqdm")),
)
STAGE_NAMES = tuple(s.name for s in STAGES)

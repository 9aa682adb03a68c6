"""GPU benchmarks (CUDA + FlashInfer): attention against the HBM roofline, TTFT, CUDA graphs.

- Attention throughput: the FlashInfer backend's per-layer forward (append, then attend)
  on Llama-3-8B-like heads (32 query, 8 KV, head_dim 128, fp16, page 16), a prefill
  batch over cached prefixes and a long-context decode batch, per kernel family ("auto",
  "fa2", "fa3" where the GPU runs it; extra_info names what the plans resolved to; the
  decode batch uses the tensor-core kernel, 4 query heads per KV head). Each records the bytes it
  must move (KV read, q read, o written, appended K/V written) and the FLOPs of the
  causal attention; the achieved bandwidth is compared with the device's roofline,
  measured in-run as a device-to-device copy (read + write), and with the nominal HBM
  bandwidth where the device name is known.
- Warm vs cold TTFT of the tiny model on the FlashInfer backend (fp16), as on CPU.
- Decode step time with CUDA graphs against eager, through Engine.step.

Rounds time `calls` back-to-back calls and one synchronize; extra_info holds per-call
figures. Every test is marked gpu and skipped with a reason where CUDA is absent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pytest
import torch

from benchmarks.report_format import Section, by_suite, div, duration, rate, ratio, table
from benchmarks.test_bench_engine import HEADLINE, round_prompts, seeded_prompt
from harness.reports.bench_results import Benchmark
from kvcache import Engine, KvCacheConfig
from kvcache.attention import BlockTable, build_metadata
from kvcache.attention.flashinfer.backend import FlashInferBackend
from kvcache.attention.flashinfer.calls import KERNEL_FAMILIES, KernelFamily
from kvcache.engine import GenerationOutput
from kvcache.storage.kv_storage import KvStorage

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer]

HQ, HKV, D, PAGE, DTYPE = 32, 8, 128, 16, torch.float16
# Nominal HBM bandwidth (bytes/s) by a substring of torch.cuda.get_device_name(); the
# first key found wins, so longer names come before names they contain.
NOMINAL_HBM = {"B200": 8.0e12, "GH200": 4.0e12, "H200": 4.8e12, "H100 NVL": 3.9e12,
               "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
               "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12}


class AttnCase(NamedTuple):
    """A batch of `requests` requests, each `cached` tokens cached and `new` new."""

    requests: int
    cached: int
    new: int


PREFILL = [pytest.param(AttnCase(8, 3584, 512), id="b8-c3584-n512"),
           pytest.param(AttnCase(1, 0, 8192), id="b1-c0-n8192")]
DECODE = [pytest.param(AttnCase(64, 4095, 1), id="b64-kv4096"),
          pytest.param(AttnCase(256, 2047, 1), id="b256-kv2048")]
FAMILIES = [pytest.param(f, id=f) for f in KERNEL_FAMILIES]


def nominal_hbm(name: str) -> float | None:
    """Nominal HBM bandwidth of the device called `name`, if it is in NOMINAL_HBM."""
    return next((bw for key, bw in NOMINAL_HBM.items() if key in name), None)


@pytest.fixture(scope="module")
def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write): the measured roofline."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def synced(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """A round: `calls` calls of fn, then wait for the device."""
    def run() -> None:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return run


def attention_step(case: AttnCase, family: KernelFamily
                   ) -> tuple[FlashInferBackend, Callable[[], torch.Tensor]]:
    """A one-layer paged cache filled with noise and a backend on `family` planned for
    `case` (skips "fa3" where the GPU cannot run it); returns the backend and its
    forward over fixed q, k, v (each call rewrites the same slots)."""
    kv_len = case.cached + case.new
    per_request = -(-kv_len // PAGE)
    storage = KvStorage(num_layers=1, num_blocks=case.requests * per_request, block_size=PAGE,
                        num_kv_heads=HKV, head_dim=D, dtype=DTYPE, device="cuda")
    for pool in (*storage.k, *storage.v):
        pool.normal_()
    table = BlockTable(case.requests, per_request)
    perm = torch.randperm(case.requests * per_request).tolist()  # scattered pages
    for r in range(case.requests):
        table.assign(r, perm[r * per_request:(r + 1) * per_request])
    md = build_metadata(table, range(case.requests), [case.cached] * case.requests,
                        [case.new] * case.requests, block_size=PAGE)
    try:
        backend = FlashInferBackend(storage=storage, num_qo_heads=HQ, num_kv_heads=HKV,
                                    head_dim=D, kernel_family=family)
    except ValueError as err:
        if family != "fa3":
            raise
        pytest.skip(str(err))
    backend.plan(md)
    T = case.requests * case.new
    q = torch.randn(T, HQ, D, dtype=DTYPE, device="cuda")
    k, v = (torch.randn(T, HKV, D, dtype=DTYPE, device="cuda") for _ in range(2))
    return backend, lambda: backend.forward(0, q, k, v)


def traffic(case: AttnCase) -> tuple[int, int]:
    """(bytes moved, FLOPs) of one forward: KV read, q read, o and appended K/V written;
    2 * 2 * D FLOPs per (query head, visible key) pair, bottom-right causal."""
    elt = torch.empty((), dtype=DTYPE).element_size()
    kv_len = case.cached + case.new
    kv_bytes = case.requests * kv_len * HKV * D * 2 * elt
    qo_bytes = 2 * case.requests * case.new * HQ * D * elt
    append_bytes = 2 * case.requests * case.new * HKV * D * 2 * elt  # read k/v, write pages
    pairs = case.requests * (case.new * case.cached + case.new * (case.new + 1) // 2)
    return kv_bytes + qo_bytes + append_bytes, 4 * HQ * D * pairs


def _attention_bench(benchmark: Any, case: AttnCase, phase: str, family: KernelFamily,
                     copy_bw: float, quick: bool) -> None:
    backend, forward = attention_step(case, family)
    calls = (3 if quick else 20) if phase == "prefill" else (10 if quick else 100)
    benchmark.pedantic(synced(forward, calls), rounds=3 if quick else 10, warmup_rounds=2)
    moved, flops = traffic(case)
    name = torch.cuda.get_device_name()
    info: dict[str, Any] = {
        "suite": "gpu_attention", "phase": phase, "device": name, "requests": case.requests,
        "cached": case.cached, "new": case.new, "num_qo_heads": HQ, "num_kv_heads": HKV,
        "head_dim": D, "page_size": PAGE, "dtype": "float16", "kernel_family": family,
        "kernels": backend.kernels._asdict(), "calls_per_round": calls,
        "bytes_per_call": moved, "flops_per_call": flops,
        "copy_bandwidth_bytes_per_s": copy_bw, "nominal_hbm_bytes_per_s": nominal_hbm(name),
        "arithmetic_intensity": flops / moved}
    if benchmark.stats is not None:
        per_call = benchmark.stats.stats.median / calls
        info.update(seconds_per_call=per_call, tokens_per_s=case.requests * case.new / per_call,
                    bytes_per_s=moved / per_call, tflops=flops / per_call / 1e12,
                    ratio_to_copy_bandwidth=moved / per_call / copy_bw)
        nominal = nominal_hbm(name)
        if nominal is not None:
            info["ratio_to_nominal_hbm"] = moved / per_call / nominal
    benchmark.extra_info.update(info)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", PREFILL)
def test_flashinfer_prefill_throughput(benchmark: Any, bench_quick: bool, case: AttnCase,
                                       family: KernelFamily, copy_bandwidth: float) -> None:
    _attention_bench(benchmark, case, "prefill", family, copy_bandwidth, bench_quick)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", DECODE)
def test_flashinfer_decode_throughput(benchmark: Any, bench_quick: bool, case: AttnCase,
                                      family: KernelFamily, copy_bandwidth: float) -> None:
    _attention_bench(benchmark, case, "decode", family, copy_bandwidth, bench_quick)


def _gpu_engine(prompt_len: int, max_batch: int, cuda_graph: bool) -> Engine:
    """The tiny model on FlashInfer, fp16; one step can prefill a whole batch."""
    blocks = 4 * max_batch * (prompt_len // 16 + 1)
    cfg = KvCacheConfig(tokens_per_block=16, max_num_blocks=blocks, enable_block_reuse=True)
    return Engine("tiny", cfg, attn_backend="flashinfer", device="cuda", dtype=DTYPE,
                  max_num_tokens=prompt_len * max_batch, max_batch_size=max_batch,
                  cuda_graph=cuda_graph, record_events=False)


@pytest.mark.parametrize("path", ["cold", "warm"])
def test_gpu_ttft(benchmark: Any, bench_quick: bool, path: str) -> None:
    """Engine.generate of a 2,048-token prompt, 1,536 cached (warm) or none (cold)."""
    L = 2048
    cached = round(HEADLINE * L) if path == "warm" else 0
    prompt = seeded_prompt(L)
    reference = _gpu_engine(L, 1, False).generate([prompt], max_new_tokens=1)[0]
    engine = _gpu_engine(L, 1, False)
    if cached:
        engine.generate([[*prompt[:cached], 0]], max_new_tokens=1)
    prompts = round_prompts(prompt, cached)
    outs: list[GenerationOutput] = []

    def first_token(p: list[int]) -> None:
        outs.append(engine.generate([p], max_new_tokens=1)[0])

    benchmark.pedantic(first_token, setup=lambda: ((next(prompts),), {}),
                       rounds=3 if bench_quick else 20, warmup_rounds=2)
    benchmark.extra_info.update(suite="gpu_ttft", path=path, device=torch.cuda.get_device_name(),
                                model="tiny", dtype="float16", prompt_tokens=L,
                                cached_tokens=cached, new_tokens=L - cached)
    assert [o.num_cached_tokens for o in outs] == [cached] * len(outs)
    # Logits, not tokens: the random tiny model has near-ties that fp16 noise may flip.
    assert outs[0].logits is not None and reference.logits is not None
    torch.testing.assert_close(outs[0].logits, reference.logits, rtol=1e-2, atol=1e-2)


@pytest.mark.cuda_graph
@pytest.mark.parametrize("batch", [1, 8], ids=["b1", "b8"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_decode_step(benchmark: Any, bench_quick: bool, batch: int, mode: str) -> None:
    """One Engine.step of a decode-only batch of `batch` requests at a 512-token context."""
    rounds, warmup = (5, 2) if bench_quick else (50, 5)
    engine = _gpu_engine(512, batch, cuda_graph=mode == "graph")
    for _ in range(batch):  # no request finishes while timed
        engine.add_request(seeded_prompt(512), max_new_tokens=rounds + warmup + 4)
    engine.step()  # every prefill in one step (the budget covers them)
    engine.step()  # the first decode step: captures the graph for this batch size
    assert engine.num_computed_tokens == batch * 513, "all requests must be decoding"
    benchmark.pedantic(engine.step, rounds=rounds, warmup_rounds=warmup)
    benchmark.extra_info.update(suite="gpu_decode_step", mode=mode, batch=batch,
                                device=torch.cuda.get_device_name(), model="tiny",
                                dtype="float16", context=512)


# -- this suite's sections of the benchmark summary (python -m benchmarks.report) --


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


SECTIONS = (
    Section("GPU", by_suite("gpu_"), _gpu),
)

"""Every flashinfer call the backend makes, bound to the real signatures on CPU.

The installed package's signatures are checked with inspect; FlashInfer 0.6.0's (the
oldest we support) are written down below from its source, so a keyword only newer
releases accept fails here too.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from kvcache.attention.flashinfer.backend import FlashInferBackend
from kvcache.attention.flashinfer.calls import (
    KERNEL_FAMILIES,
    Call,
    KernelFamily,
    KernelParams,
    PlanInputs,
    StepBuffers,
    append_call,
    check_kernel_family,
    decode_plan_call,
    decode_wrapper_call,
    graph_append_rows,
    prefill_plan_call,
    prefill_wrapper_call,
    run_call,
)
from kvcache.storage.kv_storage import KvLayout
from tests.unit.attention.support import Scenario

LAYOUTS = [pytest.param("NHD", id="nhd"), pytest.param("HND", id="hnd")]
FAMILIES = [pytest.param(f, id=f) for f in KERNEL_FAMILIES]


@pytest.fixture(scope="session")
def fi() -> ModuleType:
    try:
        with warnings.catch_warnings():  # its optional kernels warn about their own deps
            warnings.simplefilter("ignore", DeprecationWarning)
            return importlib.import_module("flashinfer")
    except ImportError as err:
        pytest.skip(f"flashinfer is not importable: {err}")


def _params(sc: Scenario, page_size: int) -> KernelParams:
    return KernelParams(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=page_size,
                        sm_scale=0.25, window_left=-1, logits_soft_cap=None,
                        dtype=sc.storage.dtype)


def _buffers(sc: Scenario) -> StepBuffers:
    B, n = sc.md.batch_size, sc.md.num_append_tokens
    return StepBuffers(*(torch.zeros(size, dtype=torch.int32) for size in (B + 1, 64, B, n, n)))


def _graph_csr(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.zeros(n, dtype=torch.int32) for n in (batch + 1, 64, batch))  # type: ignore[return-value]


def _bind(fn: Callable[..., Any], call: Call, *, method: bool) -> None:
    sig = inspect.signature(fn)
    kinds = {p.kind for p in sig.parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{fn.__qualname__} takes **kwargs"
    sig.bind(*((None,) if method else ()), *call.args, **call.kwargs)


def _plan_target(cls: type) -> Callable[..., Any]:
    # 0.7 decode plan() forwards **kwargs to _plan_impl, where the keywords are parsed.
    plan = cls.plan
    if any(p.kind is inspect.Parameter.VAR_KEYWORD
           for p in inspect.signature(plan).parameters.values()):
        return cls._plan_impl  # type: ignore[attr-defined, no-any-return]
    return plan  # type: ignore[no-any-return]


@pytest.mark.flashinfer
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_wrapper_and_plan_calls_bind(fi: ModuleType, layout: KvLayout,
                                     family: KernelFamily) -> None:
    sc = Scenario([(5, 6), (13, 1)], page_size=4, layout=layout, dtype=torch.float16)
    params = _params(sc, 4)
    workspace = torch.empty(16, dtype=torch.uint8)
    prefill, decode = fi.BatchPrefillWithPagedKVCacheWrapper, fi.BatchDecodeWithPagedKVCacheWrapper
    _bind(prefill.__init__, prefill_wrapper_call(workspace, layout, family), method=True)
    for cores in (False, True):
        _bind(decode.__init__, decode_wrapper_call(workspace, layout, cores, family), method=True)
        _bind(decode.__init__, decode_wrapper_call(workspace, layout, cores, family,
                                                   _graph_csr(sc.md.batch_size)), method=True)
    inputs = PlanInputs.of(sc.md)
    _bind(_plan_target(prefill), prefill_plan_call(params, inputs), method=True)
    _bind(_plan_target(decode), decode_plan_call(params, inputs), method=True)


@pytest.mark.flashinfer
@pytest.mark.parametrize("layout", LAYOUTS)
def test_run_and_append_calls_bind(fi: ModuleType, layout: KvLayout) -> None:
    sc = Scenario([(5, 6), (13, 1)], page_size=4, layout=layout, dtype=torch.float16)
    pages = sc.storage.page_view(0, 4)
    for cls in (fi.BatchPrefillWithPagedKVCacheWrapper, fi.BatchDecodeWithPagedKVCacheWrapper):
        for lse in (False, True):
            inspect.signature(cls.run).bind(None, *run_call(sc.q[0], pages, lse).args,
                                            **run_call(sc.q[0], pages, lse).kwargs)
    call = append_call(sc.k_new[0], sc.v_new[0], _buffers(sc), pages, layout)
    _bind(fi.page.append_paged_kv_cache, call, method=False)
    assert call.kwargs["kv_layout"] == layout


@pytest.mark.parametrize("layout", [*LAYOUTS, pytest.param("BLHNC", id="blhnc")])
@pytest.mark.parametrize("page_size", [pytest.param(8, id="p8"), pytest.param(2, id="b8p2")])
def test_page_views_meet_flashinfer_stride_rules(layout: KvLayout, page_size: int) -> None:
    """What the backend hands FlashInfer: kv_layout NHD or HND (packed storage reads as
    HND pages), K and V views with identical strides (its decode kernel checks this), a
    unit channel stride, and strides that fit its uint32 fields."""
    sc = Scenario([(5, 6), (13, 1)], page_size=page_size, layout=layout, dtype=torch.float16)
    assert sc.storage.page_layout == ("NHD" if layout == "NHD" else "HND")
    for layer in range(sc.num_layers):
        k_view, v_view = sc.storage.page_view(layer, page_size)
        assert k_view.stride() == v_view.stride(), f"layer {layer}"
        assert k_view.stride(-1) == 1 and max(k_view.stride()) < 2**32
        token_dim = 1 if sc.storage.page_layout == "NHD" else 2
        assert k_view.shape[token_dim] == page_size
        call = append_call(sc.k_new[layer], sc.v_new[layer], _buffers(sc), (k_view, v_view),
                           sc.storage.page_layout)
        assert call.kwargs["kv_layout"] == sc.storage.page_layout
        assert call.args[4][0] is k_view  # the view itself, no contiguous copy


# FlashInfer 0.6.0 signatures, from its flashinfer/{prefill,decode,page}.py:
# (required positional names, optional names).
V060: dict[str, tuple[list[str], list[str]]] = {
    "prefill.__init__": (["self", "float_workspace_buffer"], [
        "kv_layout", "use_cuda_graph", "qo_indptr_buf", "paged_kv_indptr_buf",
        "paged_kv_indices_buf", "paged_kv_last_page_len_buf", "custom_mask_buf",
        "mask_indptr_buf", "backend", "jit_args", "jit_kwargs"]),
    "decode.__init__": (["self", "float_workspace_buffer"], [
        "kv_layout", "use_cuda_graph", "use_tensor_cores", "paged_kv_indptr_buffer",
        "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer", "backend", "jit_args"]),
    "prefill.plan": (["self", "qo_indptr", "paged_kv_indptr", "paged_kv_indices",
                      "paged_kv_last_page_len", "num_qo_heads", "num_kv_heads", "head_dim_qk",
                      "page_size"], [
        "head_dim_vo", "custom_mask", "packed_custom_mask", "causal", "pos_encoding_mode",
        "use_fp16_qk_reduction", "sm_scale", "window_left", "logits_soft_cap", "rope_scale",
        "rope_theta", "q_data_type", "kv_data_type", "o_data_type", "non_blocking"]),
    "decode.plan": (["self", "indptr", "indices", "last_page_len", "num_qo_heads",
                     "num_kv_heads", "head_dim", "page_size"], [
        "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
        "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking"]),
    "append_paged_kv_cache": (["append_key", "append_value", "batch_indices", "positions",
                               "paged_kv_cache", "kv_indices", "kv_indptr",
                               "kv_last_page_len"], ["kv_layout"]),
}


def _v060(name: str) -> inspect.Signature:
    required, optional = V060[name]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(n, kind) for n in required]
                             + [inspect.Parameter(n, kind, default=None) for n in optional])


@pytest.mark.flashinfer
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_calls_bind_to_flashinfer_060_signatures(layout: KvLayout, family: KernelFamily) -> None:
    sc = Scenario([(5, 6), (13, 1)], page_size=4, layout=layout, dtype=torch.float16)
    params, ws = _params(sc, 4), torch.empty(16, dtype=torch.uint8)
    inputs = PlanInputs.of(sc.md)
    calls = {
        "prefill.__init__": prefill_wrapper_call(ws, layout, family),
        "decode.__init__": decode_wrapper_call(ws, layout, True, family,
                                               _graph_csr(sc.md.batch_size)),
        "prefill.plan": prefill_plan_call(params, inputs),
        "decode.plan": decode_plan_call(params, inputs),
    }
    for name, call in calls.items():
        _v060(name).bind(None, *call.args, **call.kwargs)
    call = append_call(sc.k_new[0], sc.v_new[0], _buffers(sc), sc.storage.page_view(0, 4), layout)
    _v060("append_paged_kv_cache").bind(*call.args, **call.kwargs)


def test_plan_calls_carry_the_metadata_and_options() -> None:
    sc = Scenario([(5, 6), (13, 1)], page_size=4, dtype=torch.float16)
    params = _params(sc, 4)
    inputs = PlanInputs.of(sc.md)
    prefill = prefill_plan_call(params, inputs)
    assert prefill.args[:4] == (sc.md.qo_indptr, sc.md.kv_indptr, sc.md.kv_indices,
                                sc.md.kv_last_page_len)
    assert prefill.args[4:] == (4, 2, 16, 4)
    assert prefill.kwargs["causal"] is True
    assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in prefill.args[:4])
    decode = decode_plan_call(params, inputs)
    assert decode.args[:3] == (sc.md.kv_indptr, sc.md.kv_indices, sc.md.kv_last_page_len)
    assert decode.args[3:] == (4, 2, 16, 4)
    for call in (prefill, decode):
        assert call.kwargs["sm_scale"] == 0.25 and call.kwargs["q_data_type"] == torch.float16
        assert call.kwargs["non_blocking"] is True  # copies from the pinned staging views


@pytest.mark.parametrize("family", FAMILIES)
def test_wrappers_are_pinned_to_the_kernel_family(family: KernelFamily) -> None:
    ws = torch.empty(16, dtype=torch.uint8)
    assert prefill_wrapper_call(ws, "NHD", family).kwargs["backend"] == family
    for cores in (False, True):
        call = decode_wrapper_call(ws, "HND", cores, family, _graph_csr(2))
        assert call.kwargs["backend"] == family and call.kwargs["use_tensor_cores"] is cores
        assert call.kwargs["use_cuda_graph"] is True


H100, B200 = "NVIDIA H100 80GB HBM3", "NVIDIA B200"


@pytest.mark.parametrize(("family", "version", "capability", "cuda", "device"), [
    pytest.param("auto", "0.6.13", (9, 0), "12.8", H100, id="auto-hopper"),
    pytest.param("fa2", "0.7.4", (10, 0), "12.9", B200, id="fa2-blackwell"),
    pytest.param("fa2", "0.6.0", (8, 0), "12.1", "NVIDIA A100", id="fa2-ampere-oldest"),
    pytest.param("fa3", "0.6.11.post1", (9, 0), "12.4", H100, id="fa3-hopper"),
    pytest.param("fa3", "0.7.4+cu128", (9, 0), "13.0", "NVIDIA H200", id="fa3-local-version"),
])
def test_kernel_family_accepted(family: str, version: str, capability: tuple[int, int],
                                cuda: str, device: str) -> None:
    assert check_kernel_family(family, flashinfer_version=version, capability=capability,
                               cuda_version=cuda, device_name=device) == family


@pytest.mark.parametrize(("family", "version", "capability", "cuda", "message"), [
    pytest.param("fa4", "0.7.4", (9, 0), "12.8", "kernel_family='fa4' is not one of auto, fa2, "
                 "fa3", id="unknown"),
    pytest.param("FA3", "0.7.4", (9, 0), "12.8", "'FA3' is not one of", id="case"),
    pytest.param("fa2", "0.5.3", (9, 0), "12.8", "flashinfer 0.5.3 is installed; this backend "
                 "needs flashinfer >= 0.6", id="old-flashinfer"),
    pytest.param("auto", "unknown", (9, 0), "12.8", "flashinfer unknown is installed",
                 id="unknown-version"),
    pytest.param("fa3", "0.6.13", (10, 0), "12.9", "needs a Hopper GPU (compute capability "
                 "9.x); NVIDIA B200 has 10.0", id="fa3-blackwell"),
    pytest.param("fa3", "0.6.13", (8, 9), "12.4", "has 8.9", id="fa3-ada"),
    pytest.param("fa3", "0.6.13", (9, 0), "12.1", "torch built for CUDA >= 12.3 (sm_90a "
                 "kernels); this torch is built for CUDA 12.1", id="fa3-old-cuda"),
    pytest.param("fa3", "0.6.13", (9, 0), None, "built for CUDA None", id="fa3-cpu-torch"),
])
def test_kernel_family_rejected(family: str, version: str, capability: tuple[int, int],
                                cuda: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_kernel_family(family, flashinfer_version=version, capability=capability,
                            cuda_version=cuda, device_name=B200 if capability[0] == 10
                            else "NVIDIA L40S")


def test_graph_append_rows_repeat_the_first_real_write() -> None:
    sc = Scenario([(9, 1), (16, 1), (3, 1)], pad_to=6)
    rows = graph_append_rows(sc.md)
    assert rows.dtype == torch.int32 and rows.shape == (3, 6)
    src, batch, pos = rows.tolist()
    assert src == [0, 1, 2, 0, 0, 0]
    assert batch == [0, 1, 2, 0, 0, 0]
    assert pos == [9, 16, 3, 9, 9, 9]
    prefill = Scenario([(0, 3)])
    with pytest.raises(ValueError, match="decode-only"):
        graph_append_rows(prefill.md)


def test_tensor_cores_for_large_query_groups() -> None:
    sc = Scenario([(0, 1)])
    base = _params(sc, 8)
    group = {g: KernelParams(2 * g, 2, 16, 8, 0.25, -1, None, torch.float16)
             for g in (1, 2, 4, 8)}
    assert {g: p.decode_uses_tensor_cores for g, p in group.items()} == {
        1: False, 2: False, 4: True, 8: True}
    assert base.decode_uses_tensor_cores is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_backend_needs_cuda() -> None:
    sc = Scenario([(0, 1)], dtype=torch.float16)
    with pytest.raises(RuntimeError, match="needs CUDA: storage is on cpu"):
        FlashInferBackend(storage=sc.storage, num_qo_heads=4, num_kv_heads=2, head_dim=16)


def test_backend_rejects_an_unknown_kernel_family_first() -> None:
    sc = Scenario([(0, 1)], dtype=torch.float16)
    with pytest.raises(ValueError, match="kernel_family='fa9' is not one of auto, fa2, fa3"):
        FlashInferBackend(storage=sc.storage, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                          kernel_family="fa9")  # type: ignore[arg-type]

"""Plan layouts: what a captured CUDA graph depends on, and how two plans differ.

The plan-info field names are checked against the planner header the installed
FlashInfer ships (include/flashinfer/attention/scheduler.cuh), so a release that adds
or reorders a field fails here. Wrappers cannot be built without CUDA; the stand-ins
below carry only the attributes PlanLayout.of reads.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcache.attention.flashinfer.plan_layout import (
    CUDA_CORES,
    PLAN_INFO_FIELDS,
    PlanLayout,
    resolved_family,
)

DECODE_INFO = (132, 0, 270336, 0, 528, 1056, 1600, 1584, 1, 1)


def _scheduler_header() -> str:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        pytest.skip("flashinfer is not installed")
    header = (Path(spec.origin).parent / "data" / "include" / "flashinfer" / "attention"
              / "scheduler.cuh")
    if not header.is_file():
        pytest.skip(f"the installed flashinfer ships no planner header at {header}")
    return header.read_text()


@pytest.mark.flashinfer
@pytest.mark.parametrize("struct", ["DecodePlanInfo", "PrefillPlanInfo", "PrefillPlanSM90Info"])
def test_plan_info_fields_match_the_installed_planner(struct: str) -> None:
    body = _scheduler_header().split(f"struct {struct} {{", 1)[1]
    to_vector = re.search(r"ToVector\(\) const \{\s*return \{(.*?)\};", body, re.S)
    assert to_vector is not None, f"{struct}::ToVector not found"
    fields = tuple(re.findall(r"\w+", to_vector[1]))
    assert PLAN_INFO_FIELDS[len(fields)] == fields


def test_changes_name_the_fields_that_moved() -> None:
    captured = PlanLayout(CUDA_CORES, DECODE_INFO)
    assert PlanLayout(CUDA_CORES, DECODE_INFO).changes(captured) == []
    # No split-KV and another padded work count: another launch, another work list.
    now = PlanLayout(CUDA_CORES, (8, *DECODE_INFO[1:9], 0))
    assert now.changes(captured) == ["padded_batch_size 132 -> 8", "split_kv 1 -> 0"]
    fa2 = PlanLayout("fa2", tuple(range(15)))
    assert PlanLayout("fa3", tuple(range(9))).changes(fa2) == ["kernels fa2 -> fa3"]
    assert PlanLayout("fa2", tuple(range(12))).changes(fa2) == ["plan info length 15 -> 12"]
    odd = PlanLayout("fa2", (1, 2, 3, 4))
    assert PlanLayout("fa2", (1, 5, 3, 6)).changes(odd) == ["plan_info[1] 2 -> 5",
                                                          "plan_info[3] 4 -> 6"]


def test_layout_of_a_planned_wrapper() -> None:
    class FfiArray:  # tvm-ffi returns the plan info as its own sequence of ints
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(DECODE_INFO)

    cuda_cores = SimpleNamespace(use_tensor_cores=False, _backend="fa3", _plan_info=FfiArray())
    assert PlanLayout.of(cuda_cores) == PlanLayout(CUDA_CORES, DECODE_INFO)
    tensor_cores = SimpleNamespace(use_tensor_cores=True, resolved_backend="fa2",
                                   _backend="fa2", _plan_info=list(range(15)))
    assert PlanLayout.of(tensor_cores) == PlanLayout("fa2", tuple(range(15)))
    prefill = SimpleNamespace(_backend="fa3", _plan_info=list(range(9)))  # no use_tensor_cores
    assert resolved_family(prefill) == "fa3"


@pytest.mark.parametrize("wrapper", [
    pytest.param(SimpleNamespace(_backend="auto", _plan_info=[1]), id="never-planned"),
    pytest.param(SimpleNamespace(_backend="trtllm-gen", _plan_info=None), id="no-plan-info"),
    pytest.param(SimpleNamespace(_backend="fa2"), id="no-attribute"),
])
def test_layout_without_plan_info_raises(wrapper: SimpleNamespace) -> None:
    with pytest.raises(RuntimeError, match="cannot check CUDA-graph replay safety: "
                       "SimpleNamespace keeps no plan info"):
        PlanLayout.of(wrapper)

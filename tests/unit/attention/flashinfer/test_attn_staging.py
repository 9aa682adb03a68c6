"""PlanStaging on the CPU: packing, alignment, growth and views (the pinned copy and its
event are the CUDA-only part; the GPU tests run every plan through it)."""

from __future__ import annotations

import pytest
import torch

from kvcache.attention.flashinfer.staging import ALIGN, PlanStaging


def test_arrays_are_packed_aligned_and_copied_once() -> None:
    staging = PlanStaging(torch.device("cpu"), capacity=64)
    arrays = [torch.tensor([0, 3, 7], dtype=torch.int32), torch.arange(5, dtype=torch.int64),
              torch.tensor([], dtype=torch.int32), torch.tensor([2**31 - 1], dtype=torch.int64)]
    staged = staging.stage(arrays)
    for side in (staged.host, staged.device):
        assert [t.tolist() for t in side] == [a.tolist() for a in arrays]
        assert all(t.dtype == torch.int32 and t.is_contiguous() for t in side)
        assert all(t.storage_offset() % ALIGN == 0 for t in side)
    # Two sides, two buffers: the device views are a copy, not the host memory.
    assert staged.host[0].data_ptr() != staged.device[0].data_ptr()
    base = staged.device[0].storage_offset()
    assert [t.storage_offset() - base for t in staged.device] == [0, 4, 12, 12]


def test_buffers_grow_and_a_new_stage_overwrites_the_last() -> None:
    staging = PlanStaging(torch.device("cpu"), capacity=8)
    first = staging.stage([torch.arange(6)])
    assert staging.capacity == 8 and first.device[0].tolist() == list(range(6))
    big = torch.arange(100, 1100)
    second = staging.stage([torch.arange(3), big])
    assert staging.capacity == 1024  # 4 + 1000 elements, rounded up to a power of two
    assert second.device[1].tolist() == big.tolist() and second.host[0].tolist() == [0, 1, 2]
    third = staging.stage([torch.tensor([9, 9])])
    assert staging.capacity == 1024 and third.device[0].data_ptr() == second.device[0].data_ptr()
    assert second.device[0].tolist() == [9, 9, 2]  # views are valid until the next stage


@pytest.mark.parametrize(("array", "message"), [
    pytest.param(torch.zeros(2, 3, dtype=torch.int32), r"array 1 must be a 1-D CPU tensor, got "
                 r"shape \(2, 3\) on cpu", id="2d"),
    pytest.param(torch.zeros((), dtype=torch.int32), r"shape \(\)", id="scalar"),
])
def test_bad_arrays_are_rejected_before_anything_is_written(array: torch.Tensor,
                                                            message: str) -> None:
    staging = PlanStaging(torch.device("cpu"), capacity=8)
    kept = staging.stage([torch.tensor([5, 6])])
    with pytest.raises(ValueError, match=message):
        staging.stage([torch.tensor([1]), array])
    assert kept.device[0].tolist() == [5, 6]

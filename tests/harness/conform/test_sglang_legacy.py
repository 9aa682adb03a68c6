"""The torch runs of the two triton launches SGLang 0.5.9-0.5.21's paged allocator makes
(`sglang_legacy`): `alloc_decode_kernel`'s rule, the extend's refusal before SGLang's
`alloc_extend_naive` reads a free page that is not there, and the swap of a module's
kernel names. Engine-free (torch only); `test_sglang_scheduler.py` runs them under
0.5.18's own allocator."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from harness.conform.adapters.sglang_legacy import (
    TorchLaunch,
    decode_slots,
    extend_slots,
    install_torch_kernels,
)

P = 4


def decode(seq_lens: list[int], last_loc: list[int], free: list[int]) -> list[int]:
    out = torch.full((len(seq_lens),), -1, dtype=torch.int64)
    TorchLaunch(decode_slots(torch))[(len(seq_lens),)](
        torch.tensor(seq_lens), torch.tensor(last_loc), torch.tensor(free), out, 4, P)
    return [int(x) for x in out]


@pytest.mark.parametrize(("seq_lens", "last_loc", "free", "slots"), [
    # seq_len 6: its token at position 5 is in its last page, after slot 21
    pytest.param([6], [21], [7], [22], id="inside-a-page"),
    # seq_len 5 (and 9): the token at position 4 (8) starts a page: the next free one's
    pytest.param([5], [19], [7, 3], [28], id="starts-a-page"),
    # in batch order: the second page-starting request takes the second free page
    pytest.param([5, 6, 9], [19, 33, 11], [7, 3], [28, 34, 12], id="in-batch-order"),
    pytest.param([1], [-1], [2], [8], id="a-first-token"),
])
def test_a_decode_slot_is_the_next_one_or_a_new_pages_first(
        seq_lens: list[int], last_loc: list[int], free: list[int], slots: list[int]) -> None:
    assert decode(seq_lens, last_loc, free) == slots


def test_a_decode_short_of_pages_writes_nothing() -> None:
    """alloc_decode refuses (None) after the launch: the launch must not read past the
    free pages, and leaves the output as it was."""
    assert decode([5, 9], [19, 11], [7]) == [-1, -1]
    assert decode([6], [21], []) == [22]  # no page needed, none free


def test_an_extend_short_of_pages_never_reaches_the_naive_fill() -> None:
    calls: list[tuple[Any, ...]] = []
    run = extend_slots(lambda *args: calls.append(args))
    out = torch.empty((9,), dtype=torch.int64)
    # prefix 3 (one page, partly filled) to 12 tokens: pages 2 and 3 are new
    run(torch.tensor([3]), torch.tensor([12]), torch.tensor([6]), torch.tensor([5]), out,
        1, P)
    assert calls == []
    run(torch.tensor([3]), torch.tensor([12]), torch.tensor([6]), torch.tensor([5, 8]),
        out, 1, P)
    assert len(calls) == 1 and calls[0][-2:] == (P, out.device)


def test_an_extend_launch_with_0_5_9s_block_size_fills_the_same_slots() -> None:
    """0.5.9's launch passes max_num_extend_tokens after the page size (a triton block
    size): the torch run takes it and hands the naive fill the same arguments."""
    calls: list[tuple[Any, ...]] = []
    run = extend_slots(lambda *args: calls.append(args))
    out = torch.empty((9,), dtype=torch.int64)
    args = (torch.tensor([3]), torch.tensor([12]), torch.tensor([6]), torch.tensor([5, 8]),
            out, 1, P)
    run(*args)
    run(*args, 16)
    assert len(calls) == 2 and calls[0] == calls[1]


def test_the_kernels_are_swapped_once() -> None:
    def naive(*args: Any) -> None:
        raise AssertionError("not launched here")

    paged = types.SimpleNamespace(alloc_extend_kernel="triton extend",
                                  alloc_decode_kernel="triton decode",
                                  alloc_extend_naive=naive)
    install_torch_kernels(paged, torch)
    first = (paged.alloc_extend_kernel, paged.alloc_decode_kernel)
    assert all(isinstance(k, TorchLaunch) for k in first)
    install_torch_kernels(paged, torch)
    assert (paged.alloc_extend_kernel, paged.alloc_decode_kernel) == first

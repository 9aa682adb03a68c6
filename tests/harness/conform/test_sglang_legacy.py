"""The torch runs of the two triton launches SGLang 0.5.6-0.5.21's paged allocator makes
(`sglang_legacy`): `alloc_decode_kernel`'s rule, the extend's refusal before SGLang's
`alloc_extend_naive` reads a free page that is not there, `alloc_extend_kernel`'s rule
where a release has no `alloc_extend_naive` (0.5.6-0.5.8), and the swap of a module's
kernel names. Engine-free (torch only); `test_sglang_scheduler.py` runs them under
0.5.18's own allocator."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from harness.conform.adapters import sglang_legacy
from harness.conform.adapters.sglang import contract as radix_contract
from harness.conform.adapters.sglang_legacy import (
    TorchLaunch,
    decode_slots,
    extend_slots,
    extend_slots_rule,
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


def extend(pre: list[int], seq: list[int], last_loc: list[int], free: list[int]) -> list[int]:
    out = torch.full((sum(seq) - sum(pre),), -1, dtype=torch.int64)
    TorchLaunch(extend_slots_rule(torch))[(len(seq),)](
        torch.tensor(pre), torch.tensor(seq), torch.tensor(last_loc), torch.tensor(free),
        out, 2, P, 16)
    return [int(x) for x in out]


def test_an_extend_fills_the_partial_page_then_new_pages_in_batch_order() -> None:
    """A: prefix 3 (slots 4-6) to 12 tokens: slot 7 (its partial page), then two new
    pages whole, 5 and 8, the first free ones; B: no prefix, 2 tokens: the next free page
    (2), its first two slots."""
    assert extend([3, 0], [12, 2], [6, -1], [5, 8, 2]) == \
        [7, 20, 21, 22, 23, 32, 33, 34, 35, 8, 9]
    # a prefix that ends on a page starts a new one; a tail shorter than a page
    assert extend([4], [6], [19], [3]) == [12, 13]
    # an extend inside the prefix's last page takes no new page
    assert extend([5], [7], [21], []) == [22, 23]


def test_an_extend_rule_short_of_pages_writes_nothing() -> None:
    assert extend([3], [12], [6], [5]) == [-1] * 9


def test_a_release_without_the_naive_fill_gets_the_rule() -> None:
    paged = types.SimpleNamespace(alloc_extend_kernel="triton extend",
                                  alloc_decode_kernel="triton decode")
    install_torch_kernels(paged, torch)
    out = torch.full((2,), -1, dtype=torch.int64)
    paged.alloc_extend_kernel[(1,)](torch.tensor([0]), torch.tensor([2]), torch.tensor([-1]),
                                    torch.tensor([3]), out, 1, P, 2)
    assert out.tolist() == [12, 13]


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


@pytest.mark.parametrize(("version", "stash"), [
    pytest.param("0.5.8", True, id="row-freed-by-the-stash"),
    pytest.param("0.5.9", False, id="row-kept")])
def test_a_release_that_frees_a_chunked_rows_lists_what_the_adapter_does_for_it(
        version: str, stash: bool) -> None:
    """To 0.5.8 a chunked request freed between its chunks takes a row before its
    release (SGLang would run one more chunk): the contract's replicated says so."""
    terms = sglang_legacy.contract(radix_contract(version, P))
    assert (sglang_legacy.STASH_REPLICATED in terms.replicated) is stash
    assert sglang_legacy.KERNELS_REPLICATED in terms.replicated

"""The host tier's memory and the checks and copies of every op the manager queues.

`HostBlocks` mirrors a storage's block tensors on the host: for each device tensor whose
axis 0 is the block axis, one CPU tensor of the same layout with `num_slots` blocks,
pinned when the device tensors live on CUDA (so device-to-host and host-to-device copies
run asynchronously on the current stream, ordered with the forward passes around them)
and plain otherwise. Copies go block by block through views of axis 0 and a narrow of
the token axis, so they hold for any layout whose blocks are contiguous along axis 0.

    device tensor [num_blocks, ...]   --BlockOffload(src, dst)-->   host [num_slots, ...]
                  block dst           <--BlockOnboard(src, dst, n)--      slot src
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.core.ops import BlockCopy, BlockOffload, BlockOnboard, KvOp


class HostBlocks:
    """Host mirrors of `tensors` (block axis 0), `num_slots` blocks each, zeroed."""

    def __init__(self, tensors: Sequence[torch.Tensor], num_slots: int) -> None:
        pin = tensors[0].device.type == "cuda"
        self.num_slots = num_slots
        self.pinned = pin
        self.tensors = tuple(torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype,
                                         device="cpu", pin_memory=pin) for t in tensors)

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def check_ops(ops: Sequence[KvOp], num_blocks: int, num_slots: int, block_size: int) -> None:
    """Raise ValueError naming the first bad op and field: an id or token count that is
    not an int (a bool, a float: torch would index with it, or fail, only once the ops
    before it were applied), an id outside its pool (device blocks [0, num_blocks), host
    slots [0, num_slots)), a token count outside [1, block_size], or something that is
    not an op. Changes nothing."""
    for i, op in enumerate(ops):
        kind = type(op)
        if kind is BlockCopy:
            ranges = (("src", num_blocks, "device blocks"), ("dst", num_blocks, "device blocks"))
        elif kind is BlockOffload:
            ranges = (("src", num_blocks, "device blocks"), ("dst", num_slots, "host slots"))
        elif kind is BlockOnboard:
            ranges = (("src", num_slots, "host slots"), ("dst", num_blocks, "device blocks"))
        else:
            raise ValueError(f"apply_copies: ops[{i}] is {op!r}, not a BlockCopy, "
                             "BlockOffload or BlockOnboard")
        for field, size, pool in ranges:
            value = getattr(op, field)
            if type(value) is not int:
                raise ValueError(f"apply_copies: ops[{i}].{field}={value!r} is a "
                                 f"{type(value).__name__}, not an int")
            if not 0 <= value < size:
                none = " (the storage has no host tier)" if size == 0 else ""
                raise ValueError(f"apply_copies: ops[{i}].{field}={value} is outside "
                                 f"[0, {size}) of the {pool}{none}")
        n = getattr(op, "num_tokens", block_size)
        if type(n) is not int:
            raise ValueError(f"apply_copies: ops[{i}].num_tokens={n!r} is a "
                             f"{type(n).__name__}, not an int")
        if not 1 <= n <= block_size:
            raise ValueError(f"apply_copies: ops[{i}].num_tokens={n} is outside "
                             f"[1, {block_size}]")


def apply_op(op: KvOp, device: Sequence[torch.Tensor], host: HostBlocks | None,
             token_dim: int) -> None:
    """Apply one checked `op` to the `device` tensors and their `host` mirrors.

    `token_dim` is the token axis of one block (a view of axis 0). Ops go one at a time
    (op-major) so that a later op may read a block or slot an earlier one just wrote, and
    so that a caller knows how many of a batch were applied when one fails.
    """
    kind = type(op)
    if kind is BlockCopy:
        n = op.num_tokens  # type: ignore[union-attr]
        for t in device:
            t[op.dst].narrow(token_dim, 0, n).copy_(t[op.src].narrow(token_dim, 0, n))
        return
    assert host is not None  # check_ops refused host ops without a host tier
    if kind is BlockOffload:
        for t, h in zip(device, host.tensors, strict=True):
            h[op.dst].copy_(t[op.src], non_blocking=True)
    else:
        n = op.num_tokens  # type: ignore[union-attr]
        for t, h in zip(device, host.tensors, strict=True):
            t[op.dst].narrow(token_dim, 0, n).copy_(h[op.src].narrow(token_dim, 0, n),
                                                   non_blocking=True)

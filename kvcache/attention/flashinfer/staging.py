"""One pinned host buffer through which a step's plan inputs reach the device in one copy.

A plan needs its index arrays twice: on the host (FlashInfer schedules there) and on
the device (kernels read them). Several `.to(device)` calls from pageable memory are
several blocking copies; packing the arrays into one pinned buffer makes it one
asynchronous copy, and FlashInfer's own copies from the pinned host views asynchronous
too. The pinned buffer is rewritten every step, so `stage` first waits until every
copy out of it was done: `release()` marks that point (after plan() enqueued its
copies). On a CPU device the same code runs with plain memory and no events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# Parts start at 16-byte boundaries: a device view then is as aligned as its own tensor.
ALIGN = 4  # int32 elements


class Staged(NamedTuple):
    """int32 views of the staged arrays, in the order given: host (pinned on CUDA) and
    device. Valid until the next `stage`."""

    host: tuple[torch.Tensor, ...]
    device: tuple[torch.Tensor, ...]


class PlanStaging:
    """Packs int32 index arrays into one pinned buffer and copies them to `device` at once.

    Not thread-safe; one per backend (a backend plans one step at a time).
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 12) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._event = torch.cuda.Event() if self._pinned else None
        self._pending = False  # a release() was recorded and not yet waited for
        self._host = self._dev = torch.empty(0, dtype=torch.int32)
        self._allocate(capacity)

    @property
    def capacity(self) -> int:
        """int32 elements the buffers hold now (they grow on demand)."""
        return self._host.numel()

    def _allocate(self, capacity: int) -> None:
        self._host = torch.empty(capacity, dtype=torch.int32, pin_memory=self._pinned)
        self._dev = torch.empty(capacity, dtype=torch.int32, device=self.device)

    def stage(self, arrays: Sequence[torch.Tensor]) -> Staged:
        """Copy 1-D integer host tensors (cast to int32) into the pinned buffer, then the
        used prefix to the device in one non-blocking copy. Waits for the previous
        release() point first; grows both buffers (to a power of two) when needed.
        Raises ValueError for a tensor that is not 1-D or not on the CPU."""
        offsets, end = [], 0
        for i, a in enumerate(arrays):
            if a.dim() != 1 or a.device.type != "cpu":
                raise ValueError(f"PlanStaging.stage: array {i} must be a 1-D CPU tensor, got "
                                 f"shape {tuple(a.shape)} on {a.device}")
            offsets.append(end)
            end += -(-a.numel() // ALIGN) * ALIGN
        if self._event is not None and self._pending:
            self._event.synchronize()  # the previous step's copies out of _host are done
            self._pending = False
        if end > self.capacity:
            self._allocate(1 << (end - 1).bit_length())
        host, dev = self._host, self._dev
        for a, off in zip(arrays, offsets, strict=True):
            host[off:off + a.numel()].copy_(a)
        dev[:end].copy_(host[:end], non_blocking=self._pinned)
        return Staged(tuple(host[o:o + a.numel()] for a, o in zip(arrays, offsets, strict=True)),
                      tuple(dev[o:o + a.numel()] for a, o in zip(arrays, offsets, strict=True)))

    def release(self) -> None:
        """Mark the current stream's position: everything enqueued so far (the staging
        copy, and any copy a plan made from the host views) precedes it."""
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(self.device))
            self._pending = True

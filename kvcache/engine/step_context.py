"""StepContext: what one forward pass asks of the engine (kvcache.model.transformer.ForwardContext)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.attention.base import AttentionBackend
from kvcache.attention.metadata import PagedMetadata
from kvcache.engine.request import Request
from kvcache.engine.step_fault import StepFault
from kvcache.engine.step_records import Chunk


class StepContext:
    """Routes attention layers to the planned backend and keeps recurrent state per request.

    Requests are the step's real ones in batch order, `start_states` their recurrent
    states at the step's start (layer -> [hidden]; a request without one starts from
    zero); padding requests (CUDA-graph decode) follow them, start from zero state and
    keep none. The states a recurrent layer hands back stay here until `commit_states`,
    which the engine calls once the step can no longer fail (its forward and sampling
    succeeded): a step that raises in a later layer or in sampling leaves every request
    at the state the step started from, so the retried step applies its tokens once.
    (Holding them here costs nothing: the same per-request writes happen, only later;
    restoring the old states on failure would instead copy every request's states every
    step.) `step_fault` is the engine's fault-injection seam (kvcache/engine/step_fault.py).
    """

    def __init__(self, backend: AttentionBackend, attn_layer: dict[int, int],
                 md: PagedMetadata, requests: list[Request],
                 start_states: Sequence[dict[int, torch.Tensor]], hidden: int,
                 device: torch.device, snapshot_rows: dict[int, int] | None = None,
                 step_fault: StepFault | None = None) -> None:
        self.backend = backend
        self.attn_layer = attn_layer
        if md.is_decode:  # one token each, padding included: no host copy of qo_indptr
            self.seq_lens = [1] * md.batch_size
        else:
            qo = md.qo_indptr.tolist()
            self.seq_lens = [qo[i + 1] - qo[i] for i in range(len(qo) - 1)]
        self.requests = requests
        self.start_states = start_states
        self.hidden = hidden
        self.device = device
        self.step_fault = step_fault
        # block id -> the step's token row whose state is that block's snapshot
        self.snapshot_rows = snapshot_rows or {}
        self.snapshot_states: dict[int, list[torch.Tensor]] = {}  # block id -> per layer
        self.new_states: dict[int, torch.Tensor] = {}  # layer -> [batch, hidden] after the step

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
        """Append k, v into this attention layer's pages, then attend."""
        out = self.backend.forward(self.attn_layer[layer], q, k, v)
        if self.step_fault is not None:
            self.step_fault("attention")
        return out

    def recurrent_state(self, layer: int) -> torch.Tensor:
        """[batch, hidden] float32: each request's state before this step."""
        zero = torch.zeros(self.hidden, dtype=torch.float32, device=self.device)
        rows = [states.get(layer, zero) for states in self.start_states]
        rows += [zero] * (len(self.seq_lens) - len(rows))
        return torch.stack(rows)

    def set_recurrent_state(self, layer: int, state: torch.Tensor,
                            token_states: torch.Tensor) -> None:
        """Keep this layer's states after the step (the requests get them at
        `commit_states`), and the states at the token rows due for a snapshot (collected
        per block, in layer order)."""
        self.new_states[layer] = state
        for block, row in self.snapshot_rows.items():
            self.snapshot_states.setdefault(block, []).append(token_states[row].detach())
        if self.step_fault is not None:
            self.step_fault("recurrent")

    def snapshots(self) -> dict[int, torch.Tensor]:
        """The snapshots the step took: block id -> [recurrent layers, hidden] float32
        (new tensors; the step's states are views of its activations)."""
        return {block: torch.stack([s.float() for s in states])
                for block, states in self.snapshot_states.items()}

    def commit_states(self) -> None:
        """The step happened: each real request's recurrent state becomes its state after
        this step (mutates the requests' `state`; assignments only, it cannot fail)."""
        for layer, state in self.new_states.items():
            for i, req in enumerate(self.requests):
                req.state[layer] = state[i].detach()


def sampled_rows(chunks: Sequence[Chunk], device: torch.device) -> torch.Tensor:
    """int64 [samplers]: the row of each sampling chunk's last token in the step's token
    order (chunks in order, each num_new rows); empty when no chunk samples."""
    rows, end = [], 0
    for c in chunks:
        end += c.num_new
        if c.samples:
            rows.append(end - 1)
    return torch.tensor(rows, dtype=torch.long, device=device)

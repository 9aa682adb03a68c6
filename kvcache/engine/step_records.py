"""The records a step hands from one part of the engine to the next.

    Chunk      `num_new` tokens of one request to compute this step, and whether they
               reach its end (it samples): the scheduler makes them, the step runner,
               its step context and the state snapshots read them
    Schedule   one step's chunks, in batch-row order, and each row's token count: the
               scheduler's answer, the runner's input
    Sampled    the step's next tokens and the logits kept for them: the runner's
               answer, the scheduler's postprocess input

One module that every engine file may import and that imports none of them, so that the
scheduler, the runner, the step context and the snapshots depend on these records and
not on each other (nano-vllm's `engine/sequence.py` plays this part). It imports no torch
at run time: the scheduler imports it and needs numpy alone; the request a chunk names
and the logits tensor are named for type checking only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from kvcache.engine.request import Request


class Chunk(NamedTuple):
    """`num_new` tokens of `req` to compute this step; `samples` if they reach its end."""

    req: Request
    num_new: int
    samples: bool


class Schedule(NamedTuple):
    """One step's work: `chunks` in row order (the running order), and `row_tokens`, the
    new tokens of every running request (0: it sits the step out), or None when each
    computes exactly one (a decode step; PersistentBatch.step's fast path)."""

    chunks: list[Chunk]
    row_tokens: list[int] | None


class Sampled(NamedTuple):
    """What a step sampled: `tokens`, the next token of every chunk that samples, in
    chunk order, and `logits`, their float32 logits on the host [samplers, vocab], or
    None when none of those requests returns logits."""

    tokens: list[int]
    logits: torch.Tensor | None

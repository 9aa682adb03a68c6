"""A request's life in the engine, the checks its input passes, and the result it ends with."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcache.core.handle import SequenceHandle
from kvcache.core.keys import ReuseScope
from kvcache.core.stats import RequestKvMetrics


class FinishReason(enum.Enum):
    """Why a request stopped."""

    LENGTH = "length"  # generated max_new_tokens
    ABORTED = "aborted"


class RequestFinishedError(ValueError):
    """`Engine.abort` of a request that already finished or was aborted.

    A separate class because, with requests finishing on another thread, this is a race
    a caller may expect and catch, unlike an id that was never issued (a ValueError).
    """


@dataclass(frozen=True)
class GenerationOutput:
    """One finished request.

    `token_ids` are the generated tokens; `logits` their float32 logits [n, vocab] when
    asked for; `num_cached_tokens` the prompt tokens reused at first admission and
    `kv_metrics` that admission's KV metrics; `num_preemptions` how often the request
    was evicted and recomputed.
    """

    request_id: int
    prompt: tuple[int, ...]
    token_ids: list[int]
    logits: torch.Tensor | None
    num_cached_tokens: int
    kv_metrics: RequestKvMetrics | None
    finish_reason: FinishReason
    num_preemptions: int = 0


@dataclass(eq=False)
class Request:
    """Mutable engine-side state of one request.

    `tokens` is prompt plus generated, as the cache's token array (`array('I')`, built
    from the checked prompt): the cache takes it with one copy, no per-token conversion,
    however often the scheduler plans its admission. The KV of tokens[:num_computed] is
    in the cache.
    Every running request has uncomputed tokens: the rest of its prompt, or its last
    sampled token.
    """

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    scope: ReuseScope | None
    priority: int
    forced: Sequence[int] | None
    return_logits: bool
    tokens: array = field(default_factory=lambda: array("I"))
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    seq: SequenceHandle | None = None  # its cache handle while it runs
    slot: int | None = None  # its batch slot (table row) while it runs
    num_computed: int = 0
    num_cached_tokens: int | None = None
    kv_metrics: RequestKvMetrics | None = None
    num_preemptions: int = 0
    state: dict[int, torch.Tensor] = field(default_factory=dict)  # recurrent layer -> [hidden]
    prompt_key: bytes | None = field(default=None, repr=False)  # prompt as uint32 bytes

    def __post_init__(self) -> None:
        self.tokens = array("I", self.prompt)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV this request still has to compute."""
        return len(self.tokens) - self.num_computed

    def output(self, reason: FinishReason) -> GenerationOutput:
        """The result as it stands."""
        logits = torch.stack(self.logits) if self.logits else None
        if logits is None and self.return_logits:
            logits = torch.empty(0)
        return GenerationOutput(self.request_id, tuple(self.prompt), list(self.generated),
                                logits if self.return_logits else None,
                                self.num_cached_tokens or 0, self.kv_metrics, reason,
                                self.num_preemptions)


def check_tokens(tokens: Sequence[int], vocab_size: int, where: str) -> list[int]:
    """`tokens` as a list of ints. Python and numpy ints pass; anything else (bools, numpy's
    too; floats; a non-sequence) raises ValueError naming `where`, the token and its index."""
    try:
        out = None if isinstance(tokens, str | bytes) else list(tokens)
    except TypeError:  # not iterable: an int, a 0-d tensor
        out = None
    if out is None:
        raise ValueError(f"{where}: expected a sequence of token ids, got {tokens!r}")
    for i, tok in enumerate(out):
        if isinstance(tok, bool) or not isinstance(tok, int | np.integer) \
                or not 0 <= tok < vocab_size:
            raise ValueError(f"{where}: token {i} is {tok!r}; tokens must be ints in "
                             f"[0, {vocab_size}) (the model's vocab_size)")
    return [int(t) for t in out]


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    """Raise ValueError unless `prompts` is a list of prompts, not one bare prompt."""
    if isinstance(prompts, str | bytes) or not hasattr(prompts, "__len__"):
        raise ValueError(f"generate: prompts must be a list of token lists, got {prompts!r}")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, int | float | np.integer | np.floating | str | bytes):
            raise ValueError(f"generate: prompts must be a list of token lists; prompt {i} is "
                             f"{prompt!r} (for one prompt, pass [[...]])")

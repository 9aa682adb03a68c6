"""A dense reference for the decoder: one sequence, every layer's K and V unpaged.

It shares no code with kvcache.attention, so the engine's paged forwards (any backend,
any layer windows) can be checked against it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvcache.model import ModelConfig, Transformer


class DenseContext:
    """One sequence, no paging: every layer's K and V in a growing tensor, explicit mask.

    Causal with GQA (query head h reads kv head h // group) and, when the layer has one,
    a sliding window in FlashInfer's convention (i - window_left <= j <= i).
    """

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.states: dict[int, Tensor] = {}
        self.num_tokens = 0
        self.seq_lens = [0]

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys = torch.cat([self.keys[layer], k]) if layer in self.keys else k  # [S, Hkv, D]
        values = torch.cat([self.values[layer], v]) if layer in self.values else v
        self.keys[layer], self.values[layer] = keys, values
        kv_len, new = keys.shape[0], q.shape[0]
        query_pos = torch.arange(kv_len - new, kv_len)[:, None]  # [T, 1]
        key_pos = torch.arange(kv_len)[None, :]  # [1, S]
        allowed = key_pos <= query_pos
        window_left = self.config.layer_window_left(layer)
        if window_left >= 0:
            allowed &= query_pos - key_pos <= window_left
        group = q.shape[1] // k.shape[1]
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)  # [Hq, T, S]
        return torch.einsum("hts,shd->thd", probs, values)  # [T, Hq, D]

    def recurrent_state(self, layer: int) -> Tensor:
        return self.states.get(layer, torch.zeros(1, self.config.hidden_size))

    def set_recurrent_state(self, layer: int, state: Tensor, token_states: Tensor) -> None:
        self.states[layer] = state

    def step(self, model: Transformer, tokens: list[int]) -> Tensor:
        """Feed the next chunk of this sequence; returns its logits [len(tokens), vocab]."""
        self.seq_lens = [len(tokens)]
        positions = torch.arange(self.num_tokens, self.num_tokens + len(tokens))
        self.num_tokens += len(tokens)
        return model(torch.tensor(tokens), positions, self)

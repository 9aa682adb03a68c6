"""A hybrid model's recurrent-state group, followed over the harness log.

A model with recurrent (Mamba) layers resumes a prompt only from a kept state, so a
match ends where a state was kept. Where states are kept is the contract's
`state_rule` (`StateRule`):

- "every-k" (the harness's, kvcache's `reuse_alignment_blocks`): with every block ending
  a multiple of `state_interval` blocks, whatever the chunks. The count oracle applies it
  itself (`OracleConfig.reuse_alignment_blocks`); this module is not used.
- "chunk-ends" (vLLM's `mamba_cache_mode="align"`, its documented rule, `config/cache.py`:
  "Only cache the mamba state of the last token of each scheduler step and when the
  token is at position i * block_size"): at a step's last computed token when it ends a
  state block (`state_interval` blocks). Each commit of the log is a step's end (the
  scheduler adapter logs one per step).
- "chunk-ends-tail": also at a step's last token when it is the prompt's last block
  boundary before its last token ((prompt - 1) // B * B): vLLM 0.33, where a state
  block wider than the hash block is matched by hash block (partial hash hits) and the
  scheduler stops a prompt there (`Scheduler._mamba_block_aligned_split`,
  `get_mamba_prefill_checkpoint_position`: "Leave tokens for logits recomputation").
- "chunk-ends-prompt-tail": the same with the prompt's last block boundary, its end
  where that is one (prompt // B * B): vLLM 0.28-0.29's partial-tail stop ("the
  prompt's partial-tail entry can only be registered by a chunk ending exactly at its
  last hash boundary").

A match then reuses the longest prefix, at most what the full-attention group matched,
that ends on a kept state of the same scope (`MambaManager.find_longest_cache_hit`: the
rightmost cached state). What the rule does not say is the engine's to get right: a
difference is a finding (docs/conformance.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

CHUNK_END_RULES = ("chunk-ends", "chunk-ends-tail", "chunk-ends-prompt-tail")


def keeps(rule: str, computed: int, prompt: int, state_tokens: int, block_size: int) -> bool:
    """Whether a step whose last computed token is the `computed`-th keeps its state
    under `rule` (one of `CHUNK_END_RULES`), for a prompt of `prompt` tokens and state
    blocks of `state_tokens` tokens."""
    if computed <= 0:
        return False
    if computed % state_tokens == 0:
        return True
    if rule == "chunk-ends-prompt-tail":
        return computed == prompt // block_size * block_size
    return rule == "chunk-ends-tail" and computed == (prompt - 1) // block_size * block_size


class StateGroup:
    """The states kept under a chunk-end rule, by (scope, prefix) (mutated by `apply`).
    `state_tokens`: the state block (state_interval blocks of `block_size`)."""

    def __init__(self, rule: str, state_tokens: int, block_size: int) -> None:
        if rule not in CHUNK_END_RULES:
            raise ValueError(f"StateGroup: rule must be one of {CHUNK_END_RULES}, got {rule!r}")
        self.rule = rule
        self.state_tokens = state_tokens
        self.block_size = block_size
        self._kept: set[tuple[Hashable, tuple[int, ...]]] = set()
        self._seqs: dict[Hashable, tuple[Hashable, list[int], int]] = {}  # scope, tokens, prompt

    def apply(self, ev: Any) -> None:
        """Follow one normalised log event (`harness.oracle.types.Event`): an admission
        starts a sequence, a commit ends one of its steps, an append adds its tokens, a
        free ends it (its kept states stay)."""
        sid = ev.seq_id
        if ev.kind == "admit":
            self._seqs[sid] = (ev.scope, list(ev.tokens), len(ev.tokens))
        elif sid not in self._seqs:
            return
        elif ev.kind == "append":
            self._seqs[sid][1].extend(ev.tokens)
        elif ev.kind == "commit":
            scope, tokens, prompt = self._seqs[sid]
            n = ev.num_tokens
            if keeps(self.rule, n, prompt, self.state_tokens, self.block_size):
                self._kept.add((scope, tuple(tokens[:n])))
        elif ev.kind == "free":
            del self._seqs[sid]

    def cut(self, tokens: Sequence[int], scope: Hashable, matched: int) -> int:
        """The reuse of `tokens` in `scope` when the full-attention group matched
        `matched` tokens: the longest prefix of at most that many ending on a kept
        state (0 when none)."""
        for n in range(matched, 0, -1):
            if (scope, tuple(tokens[:n])) in self._kept:
                return n
        return 0

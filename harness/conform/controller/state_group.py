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
- "extend-end" (SGLang 0.5.23's `UnifiedRadixCache` MAMBA component with its extra
  buffer): **one** state per extend, at start + floor(extend / g) * g for an extend of
  the prompt from `start` (the tokens computed before it) and g the state block, none
  when the extend is shorter than g (`schedule_batch.py:3175-3183`, `:3232`); where the
  admission's full-attention match passed a multiple of g beyond the state it resumed
  from (the "branching" point, `unified_cache/components/mamba.py:176-194`), an extend
  reaching past that point keeps it instead, when it lies a multiple of g after the
  extend's start (`schedule_batch.py:3216-3231`). Decoding, SGLang tracks a state
  every lcm(g, `mamba_track_interval`) tokens (`schedule_batch.py:3815-3817`, its result
  processor records it, `batch_result_processor.py:1389-1427`) and a finished request
  gives the tree its last one (`unified_cache/components/mamba.py:582-601`): a commit
  past the prompt (the decoded tokens, committed when the request ends) keeps a state
  at the last multiple of g past the prompt within it, the adapter setting
  `mamba_track_interval` to g.

A match then reuses the longest prefix, at most what the full-attention group matched,
that ends on a kept state of the same scope (`MambaManager.find_longest_cache_hit`: the
rightmost cached state). What the rule does not say is the engine's to get right: a
difference is a finding (docs/conformance.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

CHUNK_END_RULES = ("chunk-ends", "chunk-ends-tail", "chunk-ends-prompt-tail")
STEP_RULES = (*CHUNK_END_RULES, "extend-end")  # the rules this module follows


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


def extend_keeps(start: int, end: int, state_tokens: int, branch: int | None) -> int | None:
    """Where an extend of tokens [start, end) keeps its one state under "extend-end"
    (None: nowhere), `branch` the branching point its admission's match named."""
    g = state_tokens
    if end - start < g:
        return None
    if branch is not None and start < branch < end and (branch - start) % g == 0:
        return branch
    return start + (end - start) // g * g


def decode_keeps(prompt: int, end: int, state_tokens: int) -> int | None:
    """Where a request decoded from `prompt` to `end` tokens ends with its last tracked
    decode state under "extend-end" (None: it tracked none; a state every
    `state_tokens`)."""
    last = end // state_tokens * state_tokens
    return last if last > prompt else None


class StateGroup:
    """The states kept under a step rule (`STEP_RULES`), by (scope, prefix) (mutated by
    `apply` and `matched`). `state_tokens`: the state block (state_interval blocks of
    `block_size`)."""

    def __init__(self, rule: str, state_tokens: int, block_size: int) -> None:
        if rule not in STEP_RULES:
            raise ValueError(f"StateGroup: rule must be one of {STEP_RULES}, got {rule!r}")
        self.rule = rule
        self.state_tokens = state_tokens
        self.block_size = block_size
        self._kept: set[tuple[Hashable, tuple[int, ...]]] = set()
        self._seqs: dict[Hashable, tuple[Hashable, list[int], int]] = {}  # scope, tokens, prompt
        self._computed: dict[Hashable, int] = {}  # live seq -> tokens computed (extend-end)
        self._branch: dict[Hashable, int] = {}  # admitted seq -> its branching point
        self._cached: dict[Hashable, int] = {}  # live seq -> its tokens in the tree

    def matched(self, seq_id: Hashable, full_match: int, reused: int) -> None:
        """An admission of `seq_id` whose full-attention group matched `full_match` tokens
        and which resumed from `reused`: under "extend-end", the branching point it names
        (the last multiple of the state block within the match, when past `reused`)."""
        if self.rule != "extend-end":
            return
        g = self.state_tokens
        point = full_match // g * g
        if point > reused:
            self._branch[seq_id] = point
        else:
            self._branch.pop(seq_id, None)

    def apply(self, ev: Any) -> None:
        """Follow one normalised log event (`harness.oracle.types.Event`): an admission
        starts a sequence, a commit ends one of its steps, an append adds its tokens, a
        free ends it (its kept states stay)."""
        sid = ev.seq_id
        if ev.kind == "admit":
            self._seqs[sid] = (ev.scope, list(ev.tokens), len(ev.tokens))
            self._computed[sid] = self._cached[sid] = ev.num_tokens
        elif sid not in self._seqs:
            return
        elif ev.kind == "append":
            self._seqs[sid][1].extend(ev.tokens)
        elif ev.kind == "commit":
            scope, tokens, prompt = self._seqs[sid]
            n = self._kept_at(sid, ev.num_tokens, prompt)
            if n is not None:
                self._kept.add((scope, tuple(tokens[:n])))
                self._cached[sid] = max(self._cached[sid], n)
        elif ev.kind == "free":
            del self._seqs[sid], self._computed[sid], self._cached[sid]
            self._branch.pop(sid, None)

    def _kept_at(self, sid: Hashable, n: int, prompt: int) -> int | None:
        """Where a commit of `sid` up to `n` tokens keeps a state (None: nowhere)."""
        if self.rule != "extend-end":
            return n if keeps(self.rule, n, prompt, self.state_tokens, self.block_size) \
                else None
        start = self._computed[sid]
        if n <= start:
            return None
        self._computed[sid] = n
        if n > prompt:  # decoded tokens: see the module's docstring
            return decode_keeps(prompt, n, self.state_tokens)
        return extend_keeps(start, n, self.state_tokens, self._branch.get(sid))

    def cached(self, seq_id: Hashable) -> int | None:
        """The tokens of the live `seq_id` its cache's tree holds under "extend-end": what
        it resumed from, or its deepest kept state (SGLang inserts a request's full KV
        only up to its last state, `unified_cache/components/mamba.py`
        `prepare_for_caching_req`); its blocks past them are its own, shared with no
        other sequence. None for a sequence this group does not follow (not live)."""
        return self._cached.get(seq_id)

    def cut(self, tokens: Sequence[int], scope: Hashable, matched: int) -> int:
        """The reuse of `tokens` in `scope` when the full-attention group matched
        `matched` tokens: the longest prefix of at most that many ending on a kept
        state (0 when none)."""
        for n in range(matched, 0, -1):
            if (scope, tuple(tokens[:n])) in self._kept:
                return n
        return 0

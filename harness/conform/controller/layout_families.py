"""The families that open the cache with a layout beyond one device pool: a host tier
behind it, and a hybrid model's recurrent state kept at block ends (`CacheOptions`
`host_blocks`, `state_interval`). Each is skipped, saying why, where the adapter opens
no such cache.

Judged with the harness's own rules (docs/design.md): a block evicted from the device
moves to the host tier and an admission reuses it from there (the count oracle's
two-tier model, `harness.oracle.tiers`, where the contract's oracle is bounded); a model
with recurrent layers resumes only from a kept state, so a match ends where the
contract's `state_rule` kept one (every block ending a multiple of `state_interval`
blocks, `OracleConfig.reuse_alignment_blocks`, or one per extend,
`state_group.StateGroup`).
"""

from __future__ import annotations

from harness.conform.controller.families import B, Check, Run, toks
from harness.conform.protocol import CacheOptions

HOST = CacheOptions(host_blocks=8)
STATES = CacheOptions(state_interval=2)


def host_tier(run: Run) -> None:
    """A pool of 8 behind which a host tier holds 8. A (4 blocks) is computed and freed;
    B (6 blocks) evicts two of A's, which move to the host; A again reuses all of its
    prompt, two blocks from the host. C and D (6 blocks each, which an engine that admits
    a prompt only with a page to spare still takes) then fill the host past what it holds, and
    what the host dropped is computed again. E (6 blocks) is aborted after its first
    chunk of 2 blocks, and F is then admitted: the host stores only what was computed."""
    a, b = toks(100, 16), toks(500, 24)
    for seq, prompt in (("A", a), ("B", b)):
        run.admit(seq, prompt)
        run.expect_admitted(f"{seq} ({len(prompt) // B} blocks of 8) is admitted")
        run.commit(seq, len(prompt))
        run.free(seq)
    run.expect("A again (its 16 tokens and 1) reuses, from the device and the host",
               run.admit("A2", [*a, 1]), run.cap(17))
    run.commit("A2", 17)
    run.free("A2")
    for seq, prompt in (("C", toks(700, 24)), ("D", toks(900, 24))):
        run.admit(seq, prompt)
        run.commit(seq, len(prompt))
        run.free(seq)
    run.observed["B again (after the host dropped what C and D pushed out) reuses"] = \
        run.admit("B2", [*b, 1])
    run.free("B2")
    run.admit("E", toks(1100, 24), first_chunk=8)
    run.commit("E", 8)
    run.free("E")  # aborted mid-prefill
    run.admit("F", toks(1300, 8))
    run.expect_admitted("F (2 blocks), after E was aborted mid-prefill, is admitted")
    run.free("F")


def hybrid_state(run: Run) -> None:
    """Recurrent state kept every 2 blocks (8 tokens): a match ends on a kept state.
    A (20 tokens, 5 blocks) is computed in one step; B shares its first 3 blocks; A again;
    C (22 tokens) computed in chunks of 12 and 10, D sharing it while C is mid-prefill and
    once C is done. What each reuses is the contract's `state_rule`'s (`_REUSE`). Each
    prompt runs to its end with reserves (an engine's scheduler may stop it short at a
    state boundary)."""
    want = _REUSE.get(run.contract.state_rule)
    if want is None:
        raise ValueError(f"hybrid_state: no expectations for state_rule "
                         f"{run.contract.state_rule!r} (contract of {run.contract.engine})")
    a = toks(100, 20)
    run.admit("A", a)
    run.reserve("A", 20)
    run.commit("A", 20)
    run.free("A")
    run.expect("B sharing A's first 3 blocks reuses (to a kept state)",
               run.admit("B", [*a[:14], *toks(500, 6)]), want[0])
    run.free("B")
    run.expect("A again reuses (to a kept state)", run.admit("A2", [*a, 1]), want[1])
    run.free("A2")
    c = toks(300, 22)
    run.admit("C", c, first_chunk=12)
    run.commit("C", 12)
    run.expect("D while C is mid-prefill (3 of 5 blocks computed) reuses",
               run.admit("D", [*c, 1]), want[2])
    run.free("D")
    run.reserve("C", 22)
    run.reserve("C", 22)
    run.commit("C", 22)
    run.free("C")
    run.expect("D again once C is done reuses", run.admit("D2", [*c, 1]), want[3])
    run.free("D2")


# What B, A again, D mid-prefill and D again reuse (tokens), by the contract's
# `state_rule`, states every 8 tokens:
# - "every-k" (the harness's): a state at every block ending a multiple of 8 tokens: B's
#   match of 12 cuts to 8, A's 20 to 16, D's 12 (C's first chunk) to 8, D's 22 to 16.
# - "extend-end" (SGLang's): one state per extend: A's at 16 (B's match of 12 reaches no
#   state: 0), C's first extend (0-12) keeps 8, its second (12-22) keeps 20 (12 + 8).
# - "chunk-ends-tail" (vLLM 0.33's): a state at a step's end on a multiple of 8 or the
#   prompt's tail stop, (prompt - 1) // 4 * 4: A runs 16 then 20 (kept: 16; B 0, A again
#   16), C's first chunk ends at 12 (none: D 0), C stops at 20, its tail (D again 20).
# - "chunk-ends-prompt-tail" (vLLM 0.28-0.29's): the tail stop is prompt // 4 * 4, so A
#   also keeps 20 (A again 20).
_REUSE: dict[str, tuple[int, int, int, int]] = {"every-k": (8, 16, 8, 16),
                                                 "extend-end": (0, 16, 8, 20),
                                                 "chunk-ends-tail": (0, 16, 0, 20),
                                                 "chunk-ends-prompt-tail": (0, 20, 0, 20)}


CHECKS: tuple[Check, ...] = (
    Check("host_tier", "host tier", "evicted blocks move to a host tier and are reused "
          "from there; what the host drops is computed again", 8, host_tier,
          options=HOST),
    Check("hybrid_state", "hybrid state", "a hybrid model's match ends on a block where its "
          "recurrent state is kept", 32, hybrid_state, options=STATES),
)

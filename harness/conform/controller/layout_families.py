"""The families that open the cache with a layout beyond one device pool: a host tier
behind it, and a hybrid model's recurrent state kept at block ends (`CacheOptions`
`host_blocks`, `state_interval`). Each is skipped, saying why, where the adapter opens
no such cache.

Judged with the harness's own rules (docs/design.md): a block evicted from the device
moves to the host tier and an admission reuses it from there (the count oracle's
two-tier model, `harness.oracle.tiers`, where the contract's oracle is bounded); a model
with recurrent layers resumes only from a kept state, so a match ends on a block that
ends a multiple of `state_interval` blocks (`OracleConfig.reuse_alignment_blocks`).
"""

from __future__ import annotations

from harness.conform.controller.families import B, Check, Run, toks
from harness.conform.protocol import CacheOptions

HOST = CacheOptions(host_blocks=8)
STATES = CacheOptions(state_interval=2)


def host_tier(run: Run) -> None:
    """A pool of 8 behind which a host tier holds 8. A (4 blocks) is computed and freed;
    B (6 blocks) evicts two of A's, which move to the host; A again reuses all of its
    prompt, two blocks from the host. C then fills the host past what it holds, and
    what the host dropped is computed again."""
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
    for seq, prompt in (("C", toks(700, 28)), ("D", toks(900, 28))):
        run.admit(seq, prompt)
        run.commit(seq, len(prompt))
        run.free(seq)
    run.observed["B again (after the host dropped what C and D pushed out) reuses"] = \
        run.admit("B2", [*b, 1])
    run.free("B2")


def hybrid_state(run: Run) -> None:
    """Recurrent state kept every 2 blocks: a match ends on a block ending a multiple of
    2 blocks. A (20 tokens, 5 blocks) is computed; B shares its first 3 blocks and
    reuses 2; A again reuses 4 of its 5; a prompt computed in chunks of 3 and 2 blocks
    keeps its state at the blocks its chunks reached, and reuses on the same rule.
    Under a chunk-end `state_rule` (states kept only at a scheduler step's end, where
    the engine's scheduler stops) the reuse is the count oracle's, which follows the
    steps (`state_group`); the family records it, and runs each prompt to its end
    with a reserve (the scheduler may stop it short at a state boundary)."""
    a = toks(100, 20)
    run.admit("A", a)
    run.reserve("A", 20)
    run.commit("A", 20)
    run.free("A")
    k = run.contract.state_interval or 1
    _expect(run, "B sharing A's first 3 blocks reuses (to a kept state)",
            run.admit("B", [*a[:14], *toks(500, 6)]), 12, k)
    run.free("B")
    _expect(run, "A again reuses (to a kept state)", run.admit("A2", [*a, 1]),
            run.cap(21), k)
    run.free("A2")
    c = toks(300, 22)
    run.admit("C", c, first_chunk=12)
    run.commit("C", 12)
    _expect(run, "D while C is mid-prefill (3 of 5 blocks computed) reuses",
            run.admit("D", [*c, 1]), 12, k)
    run.free("D")
    run.reserve("C", 22)
    run.reserve("C", 22)
    run.commit("C", 22)
    run.free("C")
    _expect(run, "D again once C is done reuses", run.admit("D2", [*c, 1]),
            run.cap(23), k)
    run.free("D2")


def _expect(run: Run, what: str, got: int | None, tokens: int, k: int) -> None:
    """Expect `tokens` of reuse cut to a kept state: whole multiples of k blocks (a
    contract matchable only at the end of the prefill publishes nothing before). Under
    a chunk-end rule only recorded: the count oracle judges it by the steps."""
    if run.contract.state_rule != "every-k":
        run.observed[what] = got
        return
    run.expect(what, got, tokens // (k * B) * (k * B))


CHECKS: tuple[Check, ...] = (
    Check("host_tier", "host tier", "evicted blocks move to a host tier and are reused "
          "from there; what the host drops is computed again", 8, host_tier,
          options=HOST),
    Check("hybrid_state", "hybrid state", "a hybrid model's match ends on a block where its "
          "recurrent state is kept", 32, hybrid_state, options=STATES),
)

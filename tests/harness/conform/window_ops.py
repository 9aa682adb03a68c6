"""The op list the engine tests of SGLang's smaller window pools share."""

from __future__ import annotations

from harness.conform import ops
from harness.conform.ops import Op


def short_window_pool_ops() -> list[Op]:
    """A window of 8 over a window pool of 8 pages of 4 tokens (the full pool 32): A's 32
    tokens in chunks of 8 fill the window pool, one decoded token needs a ninth window
    page, A freed; B sharing A's first 12 tokens, freed. Steps 7-9 are the last commit,
    the decode step and its commit; step 11 is B's admission."""
    a = list(range(100, 132))
    op_list = [ops.admit("A", a, first_chunk=8), ops.commit("A", 8)]
    for end in (16, 24, 32):
        op_list += [ops.reserve("A", end), ops.commit("A", end)]
    return [*op_list, ops.append("A", [900]), ops.commit("A", 33), ops.free("A"),
            ops.admit("B", [*a[:12], *range(700, 712)]), ops.free("B")]

"""The op lists the engine tests of SGLang's sliding-window caches share."""

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


def decode_run_ops(decoded: int) -> list[Op]:
    """A window's decode run: A's 24 tokens in chunks of 8 (pages of 4), `decoded`
    tokens decoded one a step, each committed, A freed; B extending A (its decoded
    tokens and one more), then D sharing A's first 16, each freed. Step 6 + 2i + 1 is
    the commit of A's i-th decoded token."""
    a, out = list(range(100, 124)), [900 + i for i in range(decoded)]
    op_list = [ops.admit("A", a, first_chunk=8), ops.commit("A", 8),
               ops.reserve("A", 16), ops.commit("A", 16),
               ops.reserve("A", 24), ops.commit("A", 24)]
    for i, t in enumerate(out):
        op_list += [ops.append("A", [t]), ops.commit("A", 25 + i)]
    return [*op_list, ops.free("A"), ops.admit("B", [*a, *out, 1]), ops.free("B"),
            ops.admit("D", [*a[:16], *range(700, 708)]), ops.free("D")]

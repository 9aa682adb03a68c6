"""In-batch prefix sharing: a request waits for a running sibling to commit their prefix.

Requests that arrive together with a common prefix would each compute it: the tree only
holds blocks once they are committed. So the scheduler holds a waiting request back
while a running request of the same scope (its leader) is still computing full blocks
the two prompts share beyond what the tree offers now, and admits it, with reuse, once
those blocks are committed (TensorRT-LLM's approach). N siblings then cost one prefill of
the shared prefix plus N suffixes.

Bound on the wait: a held request waits only while its leader's prefill has not reached
the end of their shared full blocks. The leader is running, so the scheduler gives it
budget every step; the wait is at most the leader's remaining prefill of the shared part,
ceil(shared tokens / the leader's per-step chunk) steps. If the leader leaves (finishes,
is aborted or preempted), the condition is re-checked against the requests still running.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvcache.core.keys import TOKEN_BYTES, common_prefix_bytes

if TYPE_CHECKING:  # request.py needs torch; this module does not
    from kvcache.engine.request import Request


def prompt_bytes(req: Request) -> bytes:
    """The request's prompt as uint32 bytes (computed once per request)."""
    if req.prompt_key is None:
        req.prompt_key = req.tokens[:len(req.prompt)].tobytes()
    return req.prompt_key


def leader_of(req: Request, reusable_blocks: int, running: Iterable[Request],
              block_size: int, alignment: int = 1) -> Request | None:
    """A running request whose prefill will commit full blocks `req` could reuse beyond
    the `reusable_blocks` the cache offers it now; None when nothing is worth waiting for.

    Only whole blocks count, capped as an admission is (never the last prompt token) and
    cut back to a multiple of `alignment` blocks as the cache cuts matches.
    """
    limit = (len(req.tokens) - 1) // block_size
    if limit <= reusable_blocks:
        return None
    mine = prompt_bytes(req)
    block_bytes = block_size * TOKEN_BYTES
    for other in running:
        if other.scope != req.scope or other.num_computed >= len(other.prompt):
            continue  # another scope, or its prompt is computed (and so committed)
        theirs = prompt_bytes(other)
        n = min(len(mine), len(theirs), limit * block_bytes)
        shared = common_prefix_bytes(mine, 0, theirs, n) // block_bytes
        shared -= shared % alignment
        if shared > reusable_blocks and other.num_computed < shared * block_size:
            return other
    return None

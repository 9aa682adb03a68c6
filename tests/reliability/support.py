"""Helpers shared by the reliability tests: tiny engines, cold references, clean checks.

A *cold* run is the reference every warm, faulted, aborted or preempted run must equal:
the same prompts on a fresh engine with block reuse off and a pool too large to preempt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.oracle import ShadowStore
from harness.oracle.after_test import capacity_of
from kvcache import Engine, KvCacheConfig, KvCacheManager, ReuseScope
from kvcache.attention.base import AttentionBackend
from kvcache.engine import GenerationOutput
from kvcache.model import Transformer
from kvcache.storage.layouts import KvLayout

# Warm and cold runs attend over the same KV in different batches and chunks; float32
# sums may differ in the last bits, never more (the unit tests use the same bound).
LOGITS_ATOL = 1e-5


@dataclass(frozen=True)
class EngineSpec:
    """How to build a small engine over the shared tiny model."""

    tokens_per_block: int = 4
    max_num_blocks: int = 64
    max_num_tokens: int = 64
    max_batch_size: int = 8
    chunked: bool = True
    reuse: bool | None = None
    partial: bool | None = None
    copy: bool | None = None
    release: bool = True  # a windowed model's cache releases what no window reaches
    host: int = 0  # host tier blocks
    attn_backend: str | type[AttentionBackend] = "torch"  # a name, or a test's own class
    layout: KvLayout = "NHD"  # the KV storage's

    def cache_config(self) -> KvCacheConfig:
        """The KvCacheConfig this spec describes."""
        return KvCacheConfig(tokens_per_block=self.tokens_per_block,
                             max_num_blocks=self.max_num_blocks,
                             enable_block_reuse=self.reuse, enable_partial_reuse=self.partial,
                             copy_on_partial_reuse=self.copy, host_cache_blocks=self.host)

    def build(self, model: Transformer) -> Engine:
        """A fresh engine (events recorded, for the oracle) over `model`."""
        return Engine(model, self.cache_config(), max_num_tokens=self.max_num_tokens,
                      max_batch_size=self.max_batch_size,
                      enable_chunked_prefill=self.chunked, release_outside_window=self.release,
                      attn_backend=self.attn_backend, layout=self.layout)


def cold_outputs(model: Transformer, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int) -> list[GenerationOutput]:
    """Outputs of `prompts` on a fresh engine without reuse, nothing preempted, and
    nothing released under a sliding window (so no release logic is in the reference)."""
    blocks = sum(len(p) + max_new_tokens for p in prompts)  # tokens_per_block 1: ample
    spec = EngineSpec(tokens_per_block=1, max_num_blocks=max(blocks, 1), max_num_tokens=4096,
                      max_batch_size=max(len(prompts), 1), reuse=False, release=False)
    return spec.build(model).generate(prompts, max_new_tokens=max_new_tokens)


def assert_same_output(expected: GenerationOutput, actual: GenerationOutput,
                       where: str) -> None:
    """Generated tokens equal and logits within LOGITS_ATOL; the message says where.

    Greedy decoding may part ways only at a near-tie: where the cold run's logits of its
    own token and of the warm run's are within 2 * LOGITS_ATOL (rounding can pick either;
    the recurrence's blocked scan makes such flips real). The logits up to and including
    that step must still agree; what follows is a different sequence, not compared.
    """
    assert expected.logits is not None and actual.logits is not None, f"{where}: no logits"
    same = 0
    for want, got in zip(expected.token_ids, actual.token_ids, strict=False):
        if want != got:
            break
        same += 1
    rows = min(len(expected.token_ids), len(actual.token_ids), same + 1)
    torch.testing.assert_close(actual.logits[:rows], expected.logits[:rows], atol=LOGITS_ATOL,
                               rtol=0, msg=lambda m: f"{where}: request {actual.request_id} "
                                                     f"logits differ from the cold run: {m}")
    parted = same < len(expected.token_ids) and same < len(actual.token_ids)
    if parted:
        cold = expected.logits[same]
        gap = float(cold[expected.token_ids[same]] - cold[actual.token_ids[same]])
        parted = gap <= 2 * LOGITS_ATOL
    assert parted or actual.token_ids == expected.token_ids, (
        f"{where}: request {actual.request_id} (prompt {list(actual.prompt)}) generated "
        f"{actual.token_ids}, the cold run {expected.token_ids}")
    assert len(actual.token_ids) == len(expected.token_ids), (
        f"{where}: request {actual.request_id} generated {len(actual.token_ids)} tokens, the "
        f"cold run {len(expected.token_ids)}")


def assert_same_outputs(expected: Sequence[GenerationOutput],
                        actual: Sequence[GenerationOutput], where: str) -> None:
    """`assert_same_output` pairwise; the lengths must agree."""
    assert len(actual) == len(expected), (f"{where}: {len(actual)} outputs, "
                                          f"expected {len(expected)}")
    for exp, act in zip(expected, actual, strict=True):
        assert_same_output(exp, act, where)


def assert_clean(manager: KvCacheManager, where: str) -> None:
    """Every block free or evictable, nothing live, and every invariant intact."""
    manager.check_integrity()
    leaks = manager.leak_report()
    assert leaks == [], f"{where}: leaked:\n  " + "\n  ".join(leaks)
    assert manager.stats().used_num_blocks == 0, f"{where}: blocks still in use"


def scope_name(scope: ReuseScope | None) -> str:
    """Short text for ids and messages."""
    return "default" if scope is None else f"salt={scope.salt!r},lora={scope.lora_id!r}"


def generate_checked(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     scopes: Sequence[ReuseScope | None] | None = None
                     ) -> tuple[list[GenerationOutput], int]:
    """`engine.generate`, a step at a time, with the capacity oracle after every step:
    usedNumBlocks must equal what the live requests need. Returns the outputs in prompt
    order and the number of steps."""
    rids = [engine.add_request(p, max_new_tokens, scopes[i] if scopes else None)
            for i, p in enumerate(prompts)]
    done: dict[int, GenerationOutput] = {}
    steps = 0
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
        steps += 1
        mgr = engine.manager
        capacity_of(mgr).check_used(mgr.stats().used_num_blocks, f"step {steps}")
    return [done[r] for r in rids], steps


def assert_provenance(engine: Engine) -> ShadowStore:
    """Replay `engine`'s cache log through the provenance oracle: every read of every
    forward pass must find the reader's own KV. Returns the oracle (for its counts)."""
    shadow = ShadowStore(engine.cache_config.tokens_per_block,
                         sliding_window=engine.cache_config.sliding_window)
    shadow.replay(engine.manager.state.events or ())
    return shadow

"""KvCacheConfig: the cache's size and reuse policy, validated once at construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvcache.core.validate import check_fields, check_int

# The most blocks a pool or the host tier may have. A block id is a page index, and the
# attention metadata (the block table, FlashInfer's kv_indices) and the host tier's slot
# indices hold them as int32; far beyond it a pool's free list (one Python int a block)
# could not even be built: list() raises OverflowError past sys.maxsize.
MAX_BLOCKS = 2**31 - 1


def _check_flag(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"KvCacheConfig.{name} must be True, False or None, got {value!r}")


@dataclass(frozen=True)
class KvCacheConfig:
    """Size and reuse policy of a KV cache.

    The three reuse flags accept None ("auto"): `enable_block_reuse=None` is on unless
    the engine knows the backend or model cannot reuse blocks; the partial-reuse flags
    default to following the flag above them. Setting a dependent flag to True while its
    parent is off is a ValueError, as is any non-positive size.

    `reuse_alignment_blocks` = k cuts every match back to a multiple of k full blocks and
    rules out partial reuse (auto resolves it off; True is a ValueError). Hybrid models
    need it: their recurrent state can only be restored where a snapshot was taken, at
    the end of every k-th block.

    `sliding_window` = W says every attention layer lets the token at position p see only
    keys p - W < j <= p (the model's `sliding_window`; a larger W is safe, a smaller one
    is not). The cache then releases a running sequence's blocks that lie wholly outside
    the window of its next token, allocates prompt blocks as chunks need them, and a
    match needs only the cached blocks inside the window of the first new token
    (kvcache/core/window.py). None: full attention.

    `host_cache_blocks` = N > 0 adds a host tier of N blocks (TensorRT-LLM's secondary
    pool): a full cached block evicted from the device pool is offloaded there and stays
    matchable; a hit onboards it back. 0 (the default) keeps no host tier. It caches
    only what block reuse caches, so N > 0 with `enable_block_reuse=False` is a
    ValueError, and it is not supported with `sliding_window` (a ValueError too).
    `max_num_blocks` and `host_cache_blocks` are at most `MAX_BLOCKS` (2**31 - 1: block
    ids are int32 page indices).
    """

    tokens_per_block: int = 16
    max_num_blocks: int = 1024
    enable_block_reuse: bool | None = None
    enable_partial_reuse: bool | None = None
    copy_on_partial_reuse: bool | None = None
    reuse_alignment_blocks: int = 1
    sliding_window: int | None = None
    host_cache_blocks: int = 0

    def __post_init__(self) -> None:
        for name, low, high in (("tokens_per_block", 1, None), ("max_num_blocks", 1, MAX_BLOCKS),
                                ("reuse_alignment_blocks", 1, None),
                                ("host_cache_blocks", 0, MAX_BLOCKS)):
            value = check_int(getattr(self, name), f"KvCacheConfig.{name}", low, high)
            object.__setattr__(self, name, value)  # a numpy integer becomes an int
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window", check_int(
                self.sliding_window, "KvCacheConfig.sliding_window", 1))
        for name in ("enable_block_reuse", "enable_partial_reuse", "copy_on_partial_reuse"):
            _check_flag(name, getattr(self, name))
        if self.enable_partial_reuse and self.reuse_alignment_blocks > 1:
            raise ValueError("KvCacheConfig.enable_partial_reuse=True cannot start reuse "
                             "inside a block, but reuse_alignment_blocks="
                             f"{self.reuse_alignment_blocks} aligns matches to whole blocks")
        if self.enable_partial_reuse and self.enable_block_reuse is False:
            raise ValueError("KvCacheConfig.enable_partial_reuse=True needs block reuse, "
                             "but enable_block_reuse=False")
        if self.host_cache_blocks and self.enable_block_reuse is False:
            raise ValueError(f"KvCacheConfig.host_cache_blocks={self.host_cache_blocks} keeps "
                             "evicted cached blocks for reuse, but enable_block_reuse=False "
                             "caches nothing; set host_cache_blocks=0")
        if self.host_cache_blocks and self.sliding_window is not None:
            raise ValueError(f"KvCacheConfig.host_cache_blocks={self.host_cache_blocks} is "
                             f"unsupported with sliding_window={self.sliding_window}: windowed "
                             "eviction hollows interior blocks, and the host tier offloads "
                             "leaves only; set host_cache_blocks=0")
        if self.copy_on_partial_reuse and not self.partial_reuse:
            raise ValueError("KvCacheConfig.copy_on_partial_reuse=True needs partial reuse, "
                             f"but enable_partial_reuse={self.enable_partial_reuse!r} with "
                             f"enable_block_reuse={self.enable_block_reuse!r}")

    @property
    def block_reuse(self) -> bool:
        """Effective block reuse (auto means on)."""
        return self.enable_block_reuse is not False

    @property
    def partial_reuse(self) -> bool:
        """Effective partial reuse."""
        if self.enable_partial_reuse is None:
            return self.block_reuse and self.reuse_alignment_blocks == 1
        return self.enable_partial_reuse and self.block_reuse

    @property
    def copy_on_partial(self) -> bool:
        """Effective copy-on-partial-reuse."""
        if self.copy_on_partial_reuse is None:
            return self.partial_reuse
        return self.copy_on_partial_reuse and self.partial_reuse

    def without_reuse(self) -> KvCacheConfig:
        """This configuration with block reuse switched off (auto resolved to off) and,
        as nothing is cached then, no host tier."""
        return replace(self, enable_block_reuse=False, enable_partial_reuse=None,
                       copy_on_partial_reuse=None, host_cache_blocks=0)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "config") -> KvCacheConfig:
        """Build from a mapping; unknown keys are a ValueError naming them and `where`."""
        check_fields(data, cls, where)
        return cls(**data)

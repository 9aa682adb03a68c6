"""Which reuse an engine can run: the effective cache config for a backend and a model."""

from __future__ import annotations

import logging
from dataclasses import replace

from kvcache.attention.base import AttentionBackend
from kvcache.core.config import KvCacheConfig
from kvcache.model.transformer import Transformer

log = logging.getLogger("kvcache.engine.engine")  # where users have always looked for it


def resolve_reuse(cfg: KvCacheConfig, backend: type[AttentionBackend], model: Transformer,
                  snapshot_interval: int = 1) -> tuple[KvCacheConfig, str | None]:
    """The effective cache config and, when reuse had to be switched off, why.

    A model with recurrent layers reuses only at recurrent-state snapshots: matches align
    to every `snapshot_interval`-th block and never start inside a block (its snapshots
    follow their blocks to a host tier and back). Raises ValueError when reuse is
    explicitly enabled for recurrent layers that cannot be snapshotted, and for partial
    reuse for any recurrent model. Reuse switched off takes the host tier with it.
    """
    layers = list(model.config.recurrent_layers)
    if layers and not model.supports_state_snapshots:
        if cfg.enable_block_reuse:
            raise ValueError(
                "enable_block_reuse=True is unsupported for a model with recurrent layers "
                f"(layers {layers}) that cannot snapshot their state: it cannot be rolled "
                "back per token; use enable_block_reuse=None (auto) or False")
        reason = ("the model has recurrent layers whose state cannot be rolled back per "
                  "token and cannot be snapshotted")
    elif layers and cfg.enable_partial_reuse:
        raise ValueError(
            "enable_partial_reuse=True is unsupported for a model with recurrent layers "
            f"(layers {layers}): reuse resumes from state snapshots taken at block ends, "
            "never inside a block; use enable_partial_reuse=None (auto) or False")
    elif not backend.supports_block_reuse:
        reason = f"attention backend {backend.name!r} does not support block reuse"
    elif cfg.block_reuse and layers:  # on, at snapshot positions only
        return replace(cfg, enable_block_reuse=True, enable_partial_reuse=False,
                       copy_on_partial_reuse=None,
                       reuse_alignment_blocks=snapshot_interval), None
    elif cfg.block_reuse:  # auto resolves to on; an explicit False stays off
        return replace(cfg, enable_block_reuse=True), None
    else:
        return cfg, None  # off by request: nothing to explain
    if cfg.block_reuse:
        log.warning("block reuse disabled: %s", reason)
    return cfg.without_reuse(), reason


def resolve_window(cfg: KvCacheConfig, backend: type[AttentionBackend], model: Transformer,
                   release: bool = True) -> KvCacheConfig:
    """The cache config with the sliding window the cache may exploit.

    A model whose attention layers all use a window W (`ModelConfig.shared_window`; one
    with full-attention layers among windowed ones has none) gets `sliding_window` = W
    (or the config's own, if at least W) unless `release` is False, the backend cannot
    read requests with released blocks, or the config has a host tier (which offloads
    leaves only, where windowed eviction hollows interior blocks); the cache then keeps
    full-attention bookkeeping, which is always correct, only larger. Recurrent layers
    do not stop release: a released block stays cached with its state snapshot until it
    is evicted, and a windowed match ends on a block inside its window, whose snapshot
    lives as long as that block. Raises ValueError for a window on a model without one
    (or with full-attention layers), one shorter than the model's, and for block reuse
    asked for explicitly with a window model on a backend without window support.
    """
    window = model.config.shared_window
    asked = cfg.sliding_window
    if window is None:
        if asked is not None:
            which = ("some of the model's layers attend without a window: their tokens"
                     if model.config.sliding_window is not None
                     else "the model attends without a window: its tokens")
            raise ValueError(f"KvCacheConfig.sliding_window={asked}, but {which} see every "
                             "earlier block")
        return cfg
    if asked is not None and asked < window:
        raise ValueError(f"KvCacheConfig.sliding_window={asked} is shorter than the model's "
                         f"window of {window}: blocks its tokens still see would be released")
    if not backend.supports_sliding_window:
        if cfg.enable_block_reuse:
            raise ValueError(
                f"enable_block_reuse=True with a sliding-window model (window {window}) on "
                f"attention backend {backend.name!r}, which does not support sliding "
                "windows; use a backend that does (torch, flashinfer) or "
                "enable_block_reuse=None/False")
        return replace(cfg, sliding_window=None)
    if not release or cfg.host_cache_blocks:
        return replace(cfg, sliding_window=None)
    return replace(cfg, sliding_window=asked or window)

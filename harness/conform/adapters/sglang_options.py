"""Which of SGLang's scheduler adapters a cache's options open, and the contract it makes
(runs in an SGLang venv, where `sglang.load_sglang` found SGLang's scheduler code):
`scheduled` opens `sglang_scheduler.SglangScheduled` over the full-attention tree, or
over a UnifiedRadixCache with more: `sglang_window.WindowScheduled` (a window),
`sglang_mamba.MambaScheduled` (a `state_interval`), `sglang_mamba.WindowMambaScheduled`
(both), `sglang_hicache.HostScheduled` (`host_blocks`, opened apart from the others);
before 0.5.22 over RadixCache, `sglang_legacy.LegacyScheduled`, with a host tier
`sglang_hicache.HiRadixScheduled` and with a `state_interval`
`sglang_mamba_radix.MambaRadixScheduled` (where the release's server builds those
trees), and over a UnifiedRadixCache the same components as from 0.5.22 under the older
code (`sglang_legacy_unified`); `contract` is the scheduler's contract with the options
the release honours and the rule of each one opened.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from harness.conform.adapters import (
    sglang_hicache,
    sglang_legacy,
    sglang_mamba,
    sglang_mamba_radix,
    sglang_scheduler,
)
from harness.conform.adapters.sglang_hicache import HiRadixScheduled, HostScheduled
from harness.conform.adapters.sglang_legacy import LegacyScheduled
from harness.conform.adapters.sglang_legacy_unified import LEGACY_CLASSES, LegacyHostScheduled
from harness.conform.adapters.sglang_mamba import MambaScheduled, WindowMambaScheduled
from harness.conform.adapters.sglang_mamba_radix import MambaRadixScheduled
from harness.conform.adapters.sglang_scheduler import SchedulerNames, SglangScheduled
from harness.conform.adapters.sglang_window import WindowScheduled, window_rules
from harness.conform.protocol import CacheOptions, Contract, OptionName

# (a window, a state_interval) -> the scheduler adapter over that tree
CLASSES: dict[tuple[bool, bool], type[SglangScheduled]] = {
    (False, False): SglangScheduled, (True, False): WindowScheduled,
    (False, True): MambaScheduled, (True, True): WindowMambaScheduled}


# why the `sglang` engine opens no window from 0.5.22 (its server's window is the
# unified tree's; SWARadixCache is driven by its caller before, `sglang_swa`)
RADIX_NO_WINDOW = ("a window here is UnifiedRadixCache's SWA component (sglang_unified), "
                   "not RadixCache's")


def contract(base: Contract, names: SchedulerNames, tree_kind: str = "radix",
             window: int | None = None, chunk_budget: int | None = None,
             state_interval: int | None = None, host_blocks: int | None = None,
             window_pool: int | None = None) -> Contract:
    """`base` (the tree's contract) as SGLang's scheduler code makes it over a tree of
    `tree_kind` (`sglang_scheduler.contract`, `chunk_budget` there); with `window`
    (tokens), over a full-and-window UnifiedRadixCache (only where `names.swa` and the
    tree is "unified": `options` says so); with `state_interval` (pages), over a
    full-and-Mamba one (where `names.mamba`; over RadixCache, a MambaRadixCache where
    `names.mamba_radix`, else the contract cites why none opens); with a window too,
    over a FULL+SWA+MAMBA one (its window pool `window_pool` pages where set,
    `sglang_window.window_pool_tokens`: honoured with a window only); with `host_blocks`
    (pages), over a hierarchical full-attention one (`HostScheduled`, where `sglang_hicache.honoured`; opened apart from a window or a
    state_interval, so `options` leaves those out of a host tier's contract and
    host_blocks out of theirs)."""
    terms = sglang_scheduler.contract(base, names, chunk_budget)
    options: tuple[OptionName, ...] = terms.options
    citations, notes, replicated = terms.citations, terms.notes, terms.replicated
    if names.swa is not None and tree_kind == "unified":
        options = ("window", *options, "window_pool")
    elif tree_kind != "unified" and names.checkpoints:  # RadixCache, 0.5.22 on
        citations += (("options.window", RADIX_NO_WINDOW),)
    if names.mamba is not None and tree_kind == "unified":
        options = (*options, "state_interval")
    elif tree_kind == "unified":
        citations += (("options.state_interval", names.no_mamba),)
    elif names.mamba_radix is not None:  # 0.5.13-0.5.14: MambaRadixCache, the server's
        options = (*options, "state_interval")
    else:
        citations += (sglang_mamba.radix_reason(base.version, names.no_mamba_radix),)
    if not (sglang_hicache.honoured(names.hicache, tree_kind, base.version)
            or (tree_kind == "radix" and sglang_hicache.honoured_radix(base.version))):
        citations += (sglang_hicache.blocked_reason(base.version, tree_kind),)
    elif host_blocks is not None:  # a host tier is opened only apart from the others
        options = tuple(x for x in options
                        if x not in ("window", "window_pool", "state_interval"))
        options = (*options, "host_blocks")
    elif window is None and state_interval is None:
        options = (*options, "host_blocks")
    if state_interval is not None:
        replicated = (*replicated, sglang_mamba.pin_stub(base.version)
                      if tree_kind == "unified" else sglang_mamba_radix.PIN_STUB)
    if host_blocks is not None:
        citations += sglang_hicache.rules(tree_kind, base.version)
        replicated = (*replicated, *sglang_hicache.replicated(base.version))
    window_rule, window_pool_rule = window_rules(base.version)
    if window is not None:
        citations += (("window", window_rule),)
    if window_pool is not None:
        citations += (("window_pool", window_pool_rule),)
    if state_interval is not None:
        rule = sglang_mamba.mamba_rule(base.version) if tree_kind == "unified" \
            else sglang_mamba_radix.MAMBA_RADIX_RULE
        citations += (("state_interval", rule),)
    return replace(terms, replicated=replicated, host_blocks=host_blocks,
                   host_stores="when-computed" if "host_blocks" in options else "on-eviction",
                   citations=citations, options=options,
                   window=window, state_interval=state_interval, window_pool=window_pool,
                   state_rule="extend-end" if state_interval is not None else "every-k",
                   window_layout="window-pool" if window is not None else "window-only",
                   notes=notes)


def scheduled(s: Any, names: SchedulerNames, tree_kind: str, base: Contract,
              num_blocks: int, block_size: int, record: bool,
              options: CacheOptions, tree_window: bool = False) -> SglangScheduled:
    """A fresh cache of SGLang's scheduler code over a tree of `tree_kind` (`s`, the
    tree's names), its contract `contract(base, ...)`: with a host tier where
    `options.host_blocks` asks for one and the release has it; else with the window (and
    its pool) and the state_interval `options` asks for, where the release has them (a
    "unified" tree only: elsewhere they are not honoured, and `open_cache` refuses them).
    The chunk budget is the server's (`server_budget`). Raises ValueError naming a
    `window_pool` asked for without a window, or one SGLang's server would refuse
    (`sglang_window.window_pool_tokens`). Before 0.5.22 (no `checkpoint_kv_cache`) it is,
    over RadixCache, `sglang_legacy.LegacyScheduled`, full attention only, or with a
    host tier its HiRadixCache (`sglang_hicache.HiRadixScheduled`, where
    `honoured_radix`), or with a `state_interval` its MambaRadixCache
    (`sglang_mamba_radix.MambaRadixScheduled`, where `names.mamba_radix`); over a
    UnifiedRadixCache the same components as from 0.5.22, each under the older code
    (`sglang_legacy_unified`);
    `tree_window`: the tree's caller opens a window apart (`sglang.load_sglang`, without
    a chunk budget), so the contract of a cache opened without a chunk budget lists the
    window's options."""
    budget = sglang_scheduler.server_budget(options.chunk_budget, block_size)
    if options.window_pool is not None and options.window is None:
        raise ValueError(f"CacheOptions.window_pool {options.window_pool} sizes a window's "
                         "pool, but no window was asked for")
    if not names.checkpoints and options.host_blocks is not None and tree_kind == "radix" \
            and sglang_hicache.honoured_radix(base.version):
        terms = sglang_legacy.contract(contract(base, names, tree_kind, None, budget,
                                                host_blocks=options.host_blocks))
        return HiRadixScheduled(s, names, tree_kind, terms, num_blocks, block_size, record)
    if not names.checkpoints and options.state_interval is not None \
            and names.mamba_radix is not None and tree_kind == "radix":
        terms = sglang_legacy.contract(contract(base, names, tree_kind, None, budget,
                                                options.state_interval))
        return MambaRadixScheduled(s, names, tree_kind, terms, num_blocks, block_size,
                                   record)
    legacy = not names.checkpoints  # before 0.5.22 (`sglang_legacy`)
    if legacy and tree_kind != "unified":  # RadixCache: full attention only
        terms = sglang_legacy.contract(contract(base, names, tree_kind, None, budget))
        if tree_window and options.chunk_budget is None:  # a window is opened apart
            terms = replace(terms, options=("window", *terms.options, "window_pool"))
        elif not tree_window and s.no_swa:  # why none opens here
            terms = replace(terms, citations=(*terms.citations, ("options.window", s.no_swa)))
        return LegacyScheduled(s, names, tree_kind, terms, num_blocks, block_size, record)
    made = sglang_legacy.contract if legacy else (lambda terms: terms)
    if options.host_blocks is not None \
            and sglang_hicache.honoured(names.hicache, tree_kind, base.version):
        terms = made(contract(base, names, tree_kind, None, budget,
                              host_blocks=options.host_blocks))
        host = LegacyHostScheduled if legacy else HostScheduled
        return host(s, names, tree_kind, terms, num_blocks, block_size, record)
    unified = tree_kind == "unified"
    window = options.window if names.swa is not None and unified else None
    state_interval = options.state_interval if names.mamba is not None and unified else None
    window_pool = options.window_pool if window is not None else None
    terms = made(contract(base, names, tree_kind, window, budget, state_interval,
                          window_pool=window_pool))
    opened = (LEGACY_CLASSES if legacy else CLASSES)[window is not None,
                                                     state_interval is not None]
    return opened(s, names, tree_kind, terms, num_blocks, block_size, record)

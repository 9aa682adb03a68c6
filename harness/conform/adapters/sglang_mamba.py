"""SGLang's own scheduler code over a FULL+MAMBA `UnifiedRadixCache` (0.5.22 on, and
0.5.19-0.5.21 under their older code: `sglang_legacy_unified`; runs in an SGLang venv):
`MambaScheduled`, `sglang_scheduler.SglangScheduled` opened with a `state_interval`, over
SGLang's default hybrid Mamba pools (`HybridReqToTokenPool` with its `MambaPool`,
`HybridLinearKVPool`), its extra buffer on and its state block `state_interval` pages,
its rule `mamba_rule` (each release's at its own lines); with a window too,
FULL+SWA+MAMBA (`WindowMambaScheduled`). What it needs beyond the full-attention path:

- `unpinned`: a decode step's `ScheduleBatch.prepare_for_decode` page-locks the Mamba
  track mask before copying it to the device (`managers/schedule_batch.py:3830`,
  `track_mask_cpu.pin_memory()`), which a CPU-only torch refuses ("Cannot access
  accelerator device when none is available"). Page-locking is a transfer optimisation
  that changes no value, so for that call only, and only where no accelerator is
  available, `Tensor.pin_memory` returns the tensor itself, and `torch.tensor` drops a
  `pin_memory=True`, the form MambaRadixCache's releases and 0.5.19-0.5.22 use too for
  the track indices (`pin_stub` lists it with the contract's replicated parts);
- `track_decode_state`: the result processor's decode-state bookkeeping for one request
  after a decode step's forward pass, SGLang's own
  `SchedulerBatchResultProcessor._handle_finish_state_updated_req`
  (`scheduler_components/batch_result_processor.py:1377-1470`: it reads the step's track
  mask, records the tracked state's length, `_mamba_prefix_cache_update` swaps the
  ping-pong slot) on a processor that has only the tree (`tree_cache`, all a request
  that has not finished reads);
- `_refused`: a refused request gives back the Mamba slot its match took, as
  SGLang's abort of a queued request does;
- `slot_problems`: the Mamba slot pool's integrity (every slot free, a state of the
  tree, or a live request's own, never two of them) and `gauges`, its sizes in SGLang's
  names.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from harness.conform.adapters.sglang_scheduler import (
    MAX_CONTEXT,
    MAX_REQUESTS,
    LiveRequest,
    SglangScheduled,
)
from harness.conform.adapters.sglang_tree import UNIFIED_ONLY
from harness.conform.adapters.sglang_window import WindowScheduled
from harness.conform.versions import parse_version

# SGLang's Mamba snapshot rule (extra buffer), each part where its own code says so: the
# contract's `state_interval` citation (its `state_rule` "extend-end"). `_MAMBA` is its
# text with each release's lines (`MAMBA_LINES`); what keeps the full KV to the last state
# and what a finished request donates is `checkpoint_kv_cache`'s from 0.5.22
# (`_CHECKPOINTED`), the tree's cache_unfinished_req and release_kv_cache's insert before
# (`_CACHED`, without 0.5.22's fallback to the previous state where the last one runs past
# the inserted key)
_MAMBA = (
    "UnifiedRadixCache(FULL, MAMBA, enable_mamba_extra_buffer) over HybridReqToTokenPool + "
    "HybridLinearKVPool (kv_cache_configurator.py{pool} _build_hybrid_req_pool): states "
    "lie on the grid g = lcm(mamba_cache_chunk_size, page) (runtime_context.py:{grid}); an "
    "extend keeps one, at prefix_len + floor(extend_len / g) * g, none when shorter "
    "than g (managers/schedule_batch.py:{extend}), or the branching point its match "
    "named when that lies inside it on its grid (unified_cache/components/{mamba}:"
    "{branch}, schedule_batch.py:{branch_sb}); {insert}; a match ends on the deepest "
    "kept state ({mamba}:{validator} create_match_validator)")
_CHECKPOINTED = (
    "checkpoint_kv_cache inserts the full KV only up to the last state "
    "({mamba}:{prepare} prepare_for_caching_req), a finished request donates its last "
    "state ({mamba}:{donate})")
_CACHED = (
    "after an extend the tree's cache_unfinished_req (through maybe_cache_unfinished_req, "
    "mem_cache/common.py:{maybe}) inserts the full KV only up to the last state "
    "(unified_radix_cache.py:{cache}, {mamba}:{prepare} prepare_for_caching_req), and a "
    "finished request donates its last tracked state, the key cut to it ({donate}; no "
    "fallback to the previous state where that one runs past the key)")
MAMBA_LINES: dict[str, dict[str, str]] = {
    "0.5.19": dict(pool=":1038", grid="1912-1925", extend="2792, :2809-2812",
                   mamba="mamba_component.py", branch="164-185", branch_sb="2835-2850",
                   validator="142", insert=_CACHED, maybe="161", cache="925-991",
                   prepare="529-606",
                   donate="release_kv_cache, mem_cache/common.py:254, then "
                          "cache_finished_req, unified_radix_cache.py:838-871, "
                          "mamba_component.py:554-570"),
    "0.5.20": dict(pool=":1104", grid="1996-2009", extend="2922, :2939-2942",
                   mamba="mamba.py", branch="164-185", branch_sb="2965-2980",
                   validator="142", insert=_CACHED, maybe="157", cache="1098-1166",
                   prepare="525-602",
                   donate="release_kv_cache, mem_cache/common.py:276, then "
                          "cache_finished_req, unified_radix_cache.py:959-994, "
                          "mamba.py:550-566"),
    "0.5.21": dict(pool=":1119", grid="1903-1916", extend="3054-3058",
                   mamba="mamba.py", branch="166-187", branch_sb="3094-3109",
                   validator="144", insert=_CACHED, maybe="172", cache="1161-1232",
                   prepare="539-615",
                   donate="release_kv_cache, mem_cache/common.py:292, then insert_req "
                          "(up_to=owned_kv_len, :316), unified_radix_cache.py:1006-1056, "
                          "mamba.py:563-579"),
    "0.5.22": dict(pool=":1540", grid="1950-1963", extend="3054-3057",
                   mamba="mamba.py", branch="169-190", branch_sb="3092-3107",
                   validator="147", insert=_CHECKPOINTED, prepare="564-642",
                   donate="542-562 _select_finished_checkpoint, used at :588-606"),
    "0.5.23": dict(pool=":1700", grid="1958-1971", extend="3175-3183, :3232",
                   mamba="mamba.py", branch="176-194", branch_sb="3216-3231",
                   validator="151", insert=_CHECKPOINTED, prepare="604",
                   donate="582-603 _select_finished_checkpoint, used at :632"),
}


def mamba_rule(version: str) -> str:
    """The Mamba snapshot rule of `version` at its own lines (a release of
    `MAMBA_LINES`), else the newest's."""
    lines = MAMBA_LINES.get(version, MAMBA_LINES["0.5.23"])
    return _MAMBA.format(**{**lines, "insert": lines["insert"].format(**lines)})



def radix_reason(version: str, why: str) -> tuple[str, str]:
    """Why a RadixCache release opens no cache with a `state_interval`, as the contract's
    citation of the option: its MambaRadixCache is not driven (`why`,
    `SchedulerNames.no_mamba_radix`), or from `UNIFIED_ONLY` the state is
    UnifiedRadixCache's alone."""
    if parse_version(version).key < parse_version(UNIFIED_ONLY).key:
        return "options.state_interval", f"MambaRadixCache is not driven here: {why}"
    return ("options.state_interval", "a Mamba state here is UnifiedRadixCache's MAMBA "
            "component (sglang_unified), not RadixCache's")


PIN_STUB = (
    "Tensor.pin_memory returns the tensor itself (and torch.tensor drops pin_memory=True) "
    "during ScheduleBatch.prepare_for_decode when no accelerator is available "
    "(harness.conform.adapters.sglang_mamba.unpinned)",
    "managers/schedule_batch.py:3830 track_mask_cpu.pin_memory() (0.5.23), the Mamba "
    "track mask page-locked before its copy to the device",
    "a CPU-only torch cannot page-lock; page-locking changes no value")
# before 0.5.23 prepare_for_decode also builds the track indices page-locked
# (set_mamba_track_indices_from_reqs, torch.tensor(..., pin_memory=True)): each
# release's (track mask, track indices) lines in managers/schedule_batch.py
PIN_LINES = {"0.5.19": (3372, 2026), "0.5.20": (3514, 2153), "0.5.21": (3649, 2229),
             "0.5.22": (3655, 2226)}


def pin_stub(version: str) -> tuple[str, str, str]:
    """The contract's `replicated` entry for `unpinned` on `version`'s UnifiedRadixCache:
    `PIN_STUB`, or before 0.5.23 (`PIN_LINES`) with that release's two page-locked
    tensors."""
    lines = PIN_LINES.get(version)
    if lines is None:
        return PIN_STUB
    mask, indices = lines
    return (PIN_STUB[0],
            f"managers/schedule_batch.py ScheduleBatch.prepare_for_decode ({version}: "
            f":{mask} track_mask_cpu.pin_memory(), :{indices} "
            f"set_mamba_track_indices_from_reqs's torch.tensor(..., pin_memory=True)): the "
            "Mamba track mask and track indices page-locked before their copies to the "
            "device", PIN_STUB[2])


@contextmanager
def unpinned(torch: Any) -> Iterator[None]:
    """While inside, `torch.Tensor.pin_memory` returns the tensor itself and
    `torch.tensor(..., pin_memory=True)` builds the tensor unpinned (0.5.14 and earlier
    ask the factory for the track indices), where `torch.accelerator.is_available()` is false
    (elsewhere nothing changes); the originals are back on exit, also when the body
    raises. Not thread-safe: the worker is one thread."""
    if torch.accelerator.is_available():
        yield
        return
    own = torch.Tensor.__dict__.get("pin_memory")  # else inherited from TensorBase
    factory = torch.tensor

    def pin_memory(self: Any, *_args: Any, **_kwargs: Any) -> Any:
        return self

    def tensor(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return factory(*args, **kwargs)

    torch.Tensor.pin_memory, torch.tensor = pin_memory, tensor
    try:
        yield
    finally:
        torch.tensor = factory
        if own is None:
            del torch.Tensor.pin_memory
        else:
            torch.Tensor.pin_memory = own


def track_decode_state(processor_class: Any, tree: Any, req: Any, batch: Any,
                       server_args: Any) -> None:
    """SGLang's result processing of one decode step for `req` (row 0 of `batch`, the
    batch `prepare_for_decode` prepared), not finished: its tracked Mamba state
    (`_handle_finish_state_updated_req` on a processor that holds only `tree`, and the
    published `server_args` where it declares them, 0.5.13-0.5.14; no model output: the
    logits are None and the non-speculative path reads none). Mutates the request's
    track fields as SGLang's scheduler would."""
    assert not req.finished(), "a finished request is released by the adapter's free"
    processor = processor_class.__new__(processor_class)
    # a frozen dataclass with slots: set as its own __init__ does; a field left unset
    # raises AttributeError where read
    object.__setattr__(processor, "tree_cache", tree)
    if "server_args" in getattr(processor_class, "__dataclass_fields__", {}):
        object.__setattr__(processor, "server_args", server_args)
    processor._handle_finish_state_updated_req(req, batch, None, 0, None)


def mamba_info(req: Any) -> Any:
    """Where `req` keeps its Mamba fields (`mamba_pool_idx`, the ping-pong track buffer):
    its `ReqKvInfo` (`req.kv`) where that declares them (0.5.19 on), else the Req."""
    kv = getattr(req, "kv", None)
    return kv if hasattr(kv, "mamba_pool_idx") else req


def holds_mamba(req: Any) -> bool:
    """Whether `req` holds a working Mamba slot (`ReqKvInfo.holds_mamba`; SGLang's
    `mamba_pool_idx is not None` before it)."""
    return mamba_info(req).mamba_pool_idx is not None


def request_slots(req: Any) -> list[int]:
    """The Mamba slots `req` holds: its working slot and its ping-pong track slots (an
    empty one is marked in `mamba_ping_pong_empty` from 0.5.21, -1 before)."""
    kv = mamba_info(req)
    out = [] if kv.mamba_pool_idx is None else [int(kv.mamba_pool_idx)]
    if kv.mamba_ping_pong_track_buffer is not None:
        track = [int(x) for x in kv.mamba_ping_pong_track_buffer.tolist()]
        empty = getattr(kv, "mamba_ping_pong_empty", None) or [x == -1 for x in track]
        out += [x for x, gone in zip(track, empty, strict=True) if not gone]
    return out


def slot_problems(rows: Any, tree: Any, reqs: Iterable[Any]) -> list[str]:
    """The Mamba slot pool of `rows` (a HybridReqToTokenPool): every slot (1..size) is
    free, a state of `tree`, or held by one of the live `reqs`, never two of them, and
    none is free twice."""
    out: list[str] = []
    alloc = rows.mamba_allocator
    free_list = [int(x) for x in alloc.free_slots.tolist()]
    tree_list = [int(x) for x in tree.all_mamba_values_flatten().tolist()]
    held = [slot for req in reqs for slot in request_slots(req)]
    free, states, own = set(free_list), set(tree_list), set(held)
    for what, items in (("free", free_list), ("tree states", tree_list),
                        ("held by live requests", held)):
        twice = sorted({x for x in items if items.count(x) > 1})
        if twice:
            out.append(f"Mamba slots twice among the {what}: {twice}")
    for what, a, b in (("held and free", own, free), ("tree states and free", states, free),
                       ("held and tree states", own, states)):
        if a & b:
            out.append(f"Mamba slots both {what}: {sorted(a & b)}")
    lost = set(range(1, alloc.size + 1)) - free - states - own
    if lost:
        out.append(f"Mamba slots owned by nobody (leaked): {sorted(lost)}")
    return out


def gauges(rows: Any, tree: Any) -> dict[str, int | float]:
    """The Mamba pool's and the tree's state gauges in SGLang's names (in slots: one a
    state). Not the harness's used blocks: the states are in their own pool, so the
    capacity oracle counts none of them."""
    return {"mamba_available_size": rows.mamba_allocator.available_size(),
            "mamba_evictable_size": tree.mamba_evictable_size(),
            "mamba_protected_size": tree.mamba_protected_size()}


class MambaScheduled(SglangScheduled):
    """`SglangScheduled` over a UnifiedRadixCache with its MAMBA component too (a state
    block of `contract.state_interval` pages), over SGLang's hybrid Mamba pools (its
    Mamba layer `mamba_layer`)."""

    mamba_layer = 1  # layer 0 full attention

    @property
    def _mamba(self) -> tuple[Any, ...]:
        """The Mamba names (`SchedulerNames.mamba`: the pools, the tree's MAMBA component,
        the result processor)."""
        assert self.n.mamba is not None and self.tree_kind == "unified", "no MAMBA tree here"
        return cast(tuple[Any, ...], self.n.mamba)

    def _state_tokens(self) -> int | None:
        assert self._contract.state_interval is not None
        return self._contract.state_interval * self.block_size

    def _request_pool(self) -> Any:
        """A hybrid Mamba model's request pool, as SGLang's server builds it by default:
        it holds the Mamba pool, with slots for each request row, its two extra-buffer
        slots and a state per page the tree can hold, so the tree never evicts a state
        for want of slots."""
        rows, _, params, shape = self._mamba[:4]
        state = params(shape=shape.create(tp_world_size=1, intermediate_size=32, n_groups=1,
                                          num_heads=2, head_dim=16, state_size=8,
                                          conv_kernel=4), layers=[self.mamba_layer])
        return rows(size=MAX_REQUESTS, mamba_size=3 * MAX_REQUESTS + self.num_blocks,
                    mamba_spec_state_size=MAX_REQUESTS, max_context_len=MAX_CONTEXT,
                    device="cpu", enable_memory_saver=False, cache_params=state,
                    mamba_layer_ids=[self.mamba_layer], enable_mamba_extra_buffer=True,
                    enable_overlap_schedule=False)

    def _kv_pools(self) -> tuple[Any, Any, Any]:
        """A hybrid Mamba model's KV pool (layer 0 full attention; layer 1 Mamba, in the
        request pool) and its page allocator, as SGLang's server builds them by
        default."""
        n, P = self.n, self.block_size
        pool = self._mamba[1]
        # 0.5.14 asks whether to transpose the KV layout (no default): SGLang's own is no
        extra = {"enable_kvcache_transpose": False} \
            if "enable_kvcache_transpose" in inspect.signature(pool).parameters else {}
        kv = pool(size=self.num_blocks * P, dtype=n.torch.float16, page_size=P, head_num=1,
                  head_dim=8, full_attention_layer_ids=[0], device="cpu",
                  enable_memory_saver=False, mamba_pool=self.rows.mamba_pool, **extra)
        alloc = n.PagedAllocator(self.num_blocks * P, P, n.torch.float16, "cpu", kv,
                                 need_sort=False)
        return kv, alloc, alloc

    def _components(self) -> tuple[Any, ...]:
        return (*super()._components(), self._mamba[4])

    def _tree_params(self) -> dict[str, Any]:
        return {**super()._tree_params(), "enable_mamba_extra_buffer": True}

    def _refused(self, req: Any) -> None:
        """A request the adder did not admit leaves the queue (the protocol's refusal): as
        SGLang aborts a queued request (`managers/scheduler.py:5716-5722` in 0.5.23,
        "For mamba radix cache"), its release without checkpoint gives back the Mamba
        slot its match took for the state it copies (`mem_cache/common.py:404-415`), so a
        refusal leaves the Mamba pool as it was. Nothing where it holds none."""
        if holds_mamba(req):
            self._release(req, checkpoint=False)

    def _prepare_decode(self, batch: Any) -> None:
        """`prepare_for_decode` with its track mask not page-locked where no accelerator
        is (`unpinned`)."""
        with unpinned(self.n.torch):
            super()._prepare_decode(batch)

    def _decode_result(self, live: LiveRequest) -> None:
        """The result processor records the state the step tracked
        (`track_decode_state`)."""
        super()._decode_result(live)
        track_decode_state(self._mamba[5], self.tree, live.req, live.batch,
                           self.n.server_args)

    def _gauges(self) -> dict[str, int | float]:
        return {**super()._gauges(), **gauges(self.rows, self.tree)}

    def _problems(self) -> list[str]:
        return super()._problems() + slot_problems(
            self.rows, self.tree, [live.req for live in self._live.values()])


class WindowMambaScheduled(MambaScheduled, WindowScheduled):
    """FULL+SWA+MAMBA: the window's KV pools (`WindowScheduled`) over the Mamba request
    pool, the Mamba layer layer 2 (as SGLang's server pools a hybrid SWA and Mamba model
    by default, kv_cache_configurator.py _build_hybrid_swa_kv_pool and
    _build_hybrid_req_pool); every other hook is both classes' in turn."""

    mamba_layer = 2  # layer 0 full attention, layer 1 the window
    _kv_pools = WindowScheduled._kv_pools

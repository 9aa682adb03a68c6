"""SGLang's own scheduler code over a FULL+MAMBA `UnifiedRadixCache` (0.5.23; runs in an
SGLang venv): `MambaScheduled`, `sglang_scheduler.SglangScheduled` opened with a
`state_interval`, over SGLang's default hybrid Mamba pools (`HybridReqToTokenPool` with
its `MambaPool`, `HybridLinearKVPool`), its extra buffer on and its state block
`state_interval` pages, its rule `MAMBA_RULE`; with a window too, FULL+SWA+MAMBA
(`WindowMambaScheduled`). What it needs beyond the full-attention path:

- `unpinned`: a decode step's `ScheduleBatch.prepare_for_decode` page-locks the Mamba
  track mask before copying it to the device (`managers/schedule_batch.py:3830`,
  `track_mask_cpu.pin_memory()`), which a CPU-only torch refuses ("Cannot access
  accelerator device when none is available"). Page-locking is a transfer optimisation
  that changes no value, so for that call only, and only where no accelerator is
  available, `Tensor.pin_memory` returns the tensor itself, and `torch.tensor` drops a
  `pin_memory=True`, the form MambaRadixCache's releases use too (`PIN_STUB` lists it
  with the contract's replicated parts);
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

# SGLang's Mamba snapshot rule (0.5.23, extra buffer), each part where its own code says
# so; the contract's `state_interval` citation (its `state_rule` "extend-end")
MAMBA_RULE = (
    "UnifiedRadixCache(FULL, MAMBA, enable_mamba_extra_buffer) over HybridReqToTokenPool + "
    "HybridLinearKVPool (kv_cache_configurator.py _build_hybrid_req_pool): states lie on "
    "the grid g = lcm(mamba_cache_chunk_size, page) (runtime_context.py:1958-1971); an "
    "extend keeps one, at prefix_len + floor(extend_len / g) * g, none when shorter "
    "than g (managers/schedule_batch.py:3175-3183, :3232), or the branching point its "
    "match named when that lies inside it on its grid (unified_cache/components/"
    "mamba.py:176-194, schedule_batch.py:3216-3231); checkpoint_kv_cache inserts the "
    "full KV only up to the last state (mamba.py prepare_for_caching_req), a finished "
    "request donates its last state (mamba.py:582-612 _select_finished_checkpoint); a "
    "match ends on the deepest kept state")


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

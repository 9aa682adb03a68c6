"""vLLM's CPU offloading connector under the scheduler adapter (runs in a vLLM venv of a
release in `READ`, 0.21.0-0.33.0): its scheduler side is vLLM's, its worker is the
adapter's.

A `VllmConfig` with `KVTransferConfig(kv_connector="OffloadingConnector",
kv_connector_extra_config={"cpu_bytes_to_use": ...})` (`transfer_config`) gives a
`Scheduler` whose connector is `OffloadingConnector` over an
`OffloadingConnectorScheduler` and a `CPUOffloadingManager` (the host tier's LRU): the
lookup of host-resident blocks, the store and load jobs of each step (the connector
metadata), the host's allocation and eviction and its events are vLLM's. The transfers
are the worker's (`offloading/worker.py`), which needs a GPU (`CPUOffloadingSpec.
get_worker`, `v1/kv_offload/cpu/spec.py:218-220`), so the adapter stands in for it
(`WorkerStandIn`): it keeps no KV values, and reports every job of a step done in that
step's own `KVConnectorOutput`, as a synchronous worker would (`REPLICATED`). The
contract's parts are here too: the rule (`HOST_RULE`; each release's own lines,
`host_rule`), which blocks the host holds (`STORES`, `stores_rule`), where the adapter
opens a host tier (`READ`) and why not elsewhere (`blocked_reason`), and the two rules
of a host hit (`FULL_HIT`, `LOAD_RESERVE`, cited by `rules`; `load_reserve`), and what
the host's events carry (`host_events`). The releases read differ in how the host is
sized (0.26.0 on: `offloading/config.py`'s chunks; 0.21.0-0.25.1:
`v1/kv_offload/cpu/spec.py` alone, `_SPEC_HEAD`, with no alignment before 0.23.0,
`alignment`), where the prompt-only store cap is (`_calc_num_offloadable_tokens` from
0.26.0, inline in `_build_store_jobs` before; 0.21.0 and 0.22.1 have none and store a
decode step's blocks too, `stores`), whether an asynchronous load reserves blocks for
the prefills in flight (not before 0.23.0), what the host's BlockStored carry (their
hashes alone before 0.24.0) and in the shape of a transfer job (before 0.25.1: one
`transfer_spec` pair, `WorkerStandIn._pairs`); the adapter's `cpu_bytes` and
`gpu_tensors` give exactly the chunks asked on each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.conform.protocol import HostEvents, HostFullHit, HostLoadReserve, HostStores

WORKER_STUB = (
    "each store and load job in a step's OffloadingConnectorMetadata is reported done in "
    "that step's own KVConnectorOutput (kv_connector_worker_meta.completed_jobs; a load "
    "that is not sync also in finished_recving), so a request waiting for its load "
    "(WAITING_FOR_REMOTE_KVS) is scheduled at the next step of the same op; no KV value "
    "moves: the adapter logs each block a job names as an offload or onboard, a store "
    "where the KV it copies is in the log: before another request's entry, before the "
    "step's loads, else at the op's end (harness.conform.adapters.vllm_offload."
    "WorkerStandIn)",
    "distributed/kv_transfer/kv_connector/v1/offloading/worker.py:219-244 "
    "handle_preemptions (jobs_to_flush and the last step's stores submitted, flushed "
    "ones waited for, before the forward), :246-270 start_kv_transfers (loads), "
    ":272-284 prepare_store_kv (stores deferred to the next step), :286-321 "
    "get_finished, :323-329 build_connector_worker_meta (0.33.0); the copies are "
    "v1/kv_offload/cpu/gpu_worker.py's (a CUDA stream, vllm._C swap_blocks_batch)",
    "the worker needs a CUDA-alike or XPU GPU (v1/kv_offload/cpu/spec.py:218-220); a "
    "synchronous report is one timing the real worker may take, never a later one")
REPLICATED = (WORKER_STUB,)

# vLLM's host-tier rule (0.33.0), the contract's `host_blocks` citation
HOST_RULE = (
    "kv_connector OffloadingConnector, CPU spec (v1/kv_offload/cpu/spec.py:97-175): the "
    "host holds cpu_bytes_to_use // round_up(page bytes x blocks_per_chunk, 4096) chunks, "
    "a chunk one GPU block unless kv_connector_extra_config sets block_size or "
    "blocks_per_chunk (offloading/config.py:121-157); every computed full chunk of a "
    "request's prompt is stored at the step that computes it (host_stores), not on "
    "eviction "
    "(offloading/scheduler.py:1815 _build_store_jobs), so the host is inclusive and the "
    "adapter sizes it num_blocks + host_blocks chunks; the lookup (:1068 _lookup, from "
    "get_num_new_matched_tokens :1210) reports host-resident chunks past the device "
    "prefix as external tokens, loaded asynchronously (WAITING_FOR_REMOTE_KVS) unless "
    "sync_load_budget_bytes covers them (:1279), and complete only when the worker "
    "reports the job (update_connector_output :2218-2310, finished_recving); the host "
    "evicts its least recently used chunks not being loaded when a store finds it full "
    "(v1/kv_offload/cpu/policies/lru.py, eviction_policy 'lru'); its events are "
    "BlockStored/BlockRemoved with medium 'CPU' (offloading/scheduler.py:2378 "
    "take_events, v1/kv_offload/cpu/manager.py)")

# vLLM's two rules of a host hit (0.33.0), the contract's `host_full_hit` and
# `host_load_reserve` with their citations
FULL_HIT: HostFullHit = "all-but-last"
FULL_HIT_RULE = (
    "a prompt whose every block the device or the host holds is looked up whole by the "
    "connector (offloading/scheduler.py:849-876 _lookup_complete_chunks: "
    "max_hit_size_tokens = num_tokens with full attention alone), to which the device's "
    "cap (v1/core/kv_cache_manager.py:301-302, num_tokens - 1) leaves the last block; "
    "such a hit is always asynchronous (offloading/scheduler.py:1279-1292 _reserve_sync_load keeps a token to "
    "compute), and when its load is done "
    "_update_waiting_for_remote_kv sets num_computed_tokens = num_tokens - 1 "
    "(v1/core/sched/scheduler.py:3515-3516, 0.33.0): the last block is loaded whole and "
    "its last token computed again, so the admission reuses num_tokens - 1")
LOAD_RESERVE: HostLoadReserve = "inflight-prefills"
LOAD_RESERVE_RULE = (
    "an asynchronous load is admitted by allocate_slots(..., reserved_blocks) only within "
    "the free blocks less _inflight_prefill_reserved_blocks() (v1/core/sched/"
    "scheduler.py:1420-1430, 0.33.0; :3432, the blocks each request of "
    "_inflight_prefills still needs to hold its whole sequence, _request_remaining_blocks "
    ":3404; v1/core/kv_cache_manager.py:582-587): a request is in flight while its "
    "prompt is partly scheduled (:1593) or its load runs (:1542)")
RULES = (("host_full_hit", FULL_HIT_RULE), ("host_load_reserve", LOAD_RESERVE_RULE))
# The same two rules' own lines in the earlier releases whose host tier opens (read
# 2026-12-02): v1/core/sched/scheduler.py's `num_computed_tokens = num_tokens - 1` in
# _update_waiting_for_remote_kv, and the allocation that reserves
# _inflight_prefill_reserved_blocks() with that method's definition (0.27.1's file is
# 0.27.0's byte for byte; 0.25.1's two methods and its reserve are 0.24.0's text; 0.23.0's
# are 0.24.0's too). 0.21.0 and 0.22.1 have the assignment alone: no reserve
# (`_NO_RESERVE`)
_RULE_LINES = {"0.23.0": (2184, 759, 2143),
               "0.24.0": (2385, 872, 2348), "0.25.1": (2437, 901, 2400),
               "0.26.0": (2582, 933, 2536), "0.27.0": (2674, 971, 2628),
               "0.27.1": (2674, 971, 2628),
               "0.28.0": (2762, 1031, 2716), "0.29.0": (2855, 1075, 2809),
               "0.30.0": (2958, 1157, 2912), "0.31.0": (3096, 1202, 3032),
               "0.32.0": (3172, 1249, 3088)}
# 0.21.0 and 0.22.1 (read 2026-12-02): the same num_tokens - 1 assignment in
# _update_waiting_for_remote_kv, and no reserve for the prefills in flight: their
# Scheduler has no _inflight_prefill_reserved_blocks, and the admission's allocate_slots
# passes no reserved_blocks; (assignment, allocate_slots lines)
_NO_RESERVE = {"0.21.0": (1994, "702-712"), "0.22.1": (2099, "721-731")}
NO_RESERVE_RULE = (
    "an asynchronous load is admitted as any admission is, within the free blocks alone: "
    "the Scheduler has no _inflight_prefill_reserved_blocks and the admission's "
    "allocate_slots (v1/core/sched/scheduler.py:{alloc}, {version}) passes no "
    "reserved_blocks")


def load_reserve(version: str) -> HostLoadReserve:
    """`version`'s `host_load_reserve` where its host tier opens: "none" where its
    scheduler reserves nothing for the prefills in flight (`_NO_RESERVE`), else
    `LOAD_RESERVE`."""
    return "none" if version in _NO_RESERVE else LOAD_RESERVE


def rules(version: str) -> tuple[tuple[str, str], ...]:
    """The citations of the host hit's two rules (`RULES`) for `version`, with its own
    lines where it is an earlier release whose host tier opens (and, where it reserves
    nothing, `NO_RESERVE_RULE`)."""
    if version in _NO_RESERVE:
        full, alloc = _NO_RESERVE[version]
        return (("host_full_hit", f"{FULL_HIT_RULE}; {version}: the same assignment at "
                                  f"v1/core/sched/scheduler.py:{full}"),
                ("host_load_reserve", NO_RESERVE_RULE.format(alloc=alloc, version=version)))
    lines = _RULE_LINES.get(version)
    if lines is None:
        return RULES
    full, use, define = lines
    return (("host_full_hit", f"{FULL_HIT_RULE}; {version}: the same assignment at "
                              f"v1/core/sched/scheduler.py:{full}"),
            ("host_load_reserve", f"{LOAD_RESERVE_RULE}; {version}: the same reserve at "
                                  f"v1/core/sched/scheduler.py:{use}, defined at :{define}"))

# Which blocks vLLM's host holds, the contract's `host_stores`, read in each release in
# `READ`: kv_connector_extra_config offload_prompt_only defaults to True (v1/kv_offload/
# base.py), and a store job reaches no further than _calc_num_offloadable_tokens (0.26.0
# on; before, the same cap inline in _build_store_jobs), which then caps it at
# req.num_prompt_tokens (offloading/scheduler.py), a finished request's too; a preempted
# request keeps its num_prompt_tokens when it resumes
STORES: HostStores = "prompt-only"
_STORES_RULE = (
    "offload_prompt_only defaults to True (v1/kv_offload/base.py:{base}), so "
    "{cap} caps every store job "
    "at req.num_prompt_tokens: the host holds the full chunks within a request's prompt "
    "(first added; a resumed request's decoded tokens are not its prompt), stored at the "
    "step that computes them{hits}; a chunk a decode step filled, or one the prompt only "
    "partly spans, is never stored{finish}")
_CALC = "_calc_num_offloadable_tokens (offloading/scheduler.py:{})"
# before 0.26.0 there is no _calc_num_offloadable_tokens: _build_store_jobs caps the
# request's tokens itself, and sets the store index to the chunks computed with no max()
# (advance_stored_idx; 0.26.0 on keep the larger), so a request resumed after a
# preemption offers its prompt's chunks again as it computes them (prepare_store passes
# on those the host still holds)
_INLINE = ("_build_store_jobs itself (offloading/scheduler.py:{cap}, no "
           "_calc_num_offloadable_tokens)")
_RESUMED = (" (again after a preemption, as the request computes them anew: the store "
            "index follows the computed tokens back, advance_stored_idx :{advance} with "
            "no max)")
_FINISH = (", not even when its request finishes (_build_store_jobs :{lines} clamps a "
           "finished request to max(num_prompt_tokens, num_tokens - 1), then the cap "
           "applies)")
# 0.21.0 and 0.22.1 have no offload_prompt_only (nowhere in v1/kv_offload/ nor in the
# connector): _build_store_jobs caps a store at req.num_tokens alone, so a block a
# decode step filled is stored too, "when-computed" (`stores`); (cap, advance_stored_idx)
_NO_PROMPT_ONLY = {"0.21.0": ("630-633", "169-174"), "0.22.1": ("682-685", "218-223")}
_WHEN_COMPUTED = (
    "no offload_prompt_only (v1/kv_offload/base.py and offloading/ have none): "
    "_build_store_jobs (offloading/scheduler.py:{cap}) caps a store job at req.num_tokens "
    "alone, so the host holds every full chunk a request computes, its prompt's and those "
    "a decode step filled, stored at the step that computes them (again after a "
    "preemption, as the request computes them anew: advance_stored_idx :{advance} with no "
    "max)")
STORES_RULES = {
    **{version: _WHEN_COMPUTED.format(cap=cap, advance=advance)
       for version, (cap, advance) in _NO_PROMPT_ONLY.items()},
    "0.23.0": _STORES_RULE.format(base="397-399", cap=_INLINE.format(cap="745-748"),
                                  hits=_RESUMED.format(advance="236-241"), finish=""),
    "0.24.0": _STORES_RULE.format(base="470-472", cap=_INLINE.format(cap="855-858"),
                                  hits=_RESUMED.format(advance="294-299"), finish=""),
    "0.25.1": _STORES_RULE.format(base="521-523", cap=_INLINE.format(cap="868-871"),
                                  hits=_RESUMED.format(advance="296-301"), finish=""),
    "0.26.0": _STORES_RULE.format(base="510-511", cap=_CALC.format("447-456"), hits="",
                                  finish=""),
    **dict.fromkeys(("0.27.0", "0.27.1"), _STORES_RULE.format(
        base="597-598", cap=_CALC.format("534-543"), hits="", finish="")),
    "0.28.0": _STORES_RULE.format(base="597-598", cap=_CALC.format("588-597"), hits="",
                                  finish=""),
    "0.29.0": _STORES_RULE.format(base="598-599", cap=_CALC.format("588-597"), hits="",
                                  finish=""),
    # 0.30.0-0.32.0 clamp a finished request as 0.33.0 does, but restart no store index
    # at admission (next_stored_chunk_idx = 0 only in reset_cache)
    "0.30.0": _STORES_RULE.format(base="601-602", cap=_CALC.format("631-640"), hits="",
                                  finish=_FINISH.format(lines="1481-1485")),
    "0.31.0": _STORES_RULE.format(base="607-608", cap=_CALC.format("660-669"), hits="",
                                  finish=_FINISH.format(lines="1518-1522")),
    "0.32.0": _STORES_RULE.format(base="620-621", cap=_CALC.format("663-672"), hits="",
                                  finish=_FINISH.format(lines="1587-1591")),
    "0.33.0": _STORES_RULE.format(
        base="729-731", cap=_CALC.format("762-771"),
        hits=" or, hit on the device, at its admission (get_num_new_matched_tokens "
             "restarts next_stored_chunk_idx at 0, :1241-1245)",
        finish=_FINISH.format(lines="1832-1836")),
}


def stores_rule(version: str) -> str:
    """The citation of `version`'s `host_stores` (a release in `READ`). Raises KeyError
    on a release not read."""
    return STORES_RULES[version]


def stores(version: str) -> HostStores:
    """`version`'s `host_stores` (a release in `READ`): "when-computed" where it has no
    offload_prompt_only (0.21.0, 0.22.1), else `STORES`. Raises KeyError on a release
    not read."""
    if version not in STORES_RULES:
        raise KeyError(version)
    return "when-computed" if version in _NO_PROMPT_ONLY else STORES


# What the host's router events carry, the contract's `host_events`: before 0.24.0 the
# connector has no offloading/events.py and no self_describing_kv_events option, and
# take_events publishes each host BlockStored with its hashes alone (parent_block_hash
# None, token_ids [], block_size 0; its BlockRemoved, hashes and medium), the only form
# those releases publish, not a fault; 0.24.0 on, `transfer_config` sets the option.
# The releases read with that form, at take_events' lines:
_PLACEHOLDER_LINES = {"0.21.0": "861-880", "0.22.1": "946-965", "0.23.0": "1029-1048"}
_HASHES_ONLY_RULE = (
    "the host's BlockStored carry their hashes alone: take_events (offloading/"
    "scheduler.py:{lines}, {version}) publishes each with parent_block_hash None, "
    "token_ids [] and block_size 0, as this release always does (it has no "
    "offloading/events.py and no self_describing_kv_events option, both from 0.24.0 on); "
    "a router folds them by hash")


def host_events(version: str) -> tuple[HostEvents, str | None]:
    """`version`'s `host_events` (a release in `READ`) and its citation: "hashes-only"
    where its connector publishes the host's BlockStored by hash alone
    (`_PLACEHOLDER_LINES`), else "self-describing" (no citation: `transfer_config` sets
    self_describing_kv_events)."""
    lines = _PLACEHOLDER_LINES.get(version)
    if lines is None:
        return "self-describing", None
    return "hashes-only", _HASHES_ONLY_RULE.format(lines=lines, version=version)

# Under a host tier an admission's reused tokens are vLLM's device hits plus the
# connector's (Scheduler.connector_prefix_cache_stats, recorded by Scheduler.schedule
# with num_external_computed_tokens, v1/core/sched/scheduler.py:1487-1506): the adapter
# reads the connector's PrefixCacheStats under CONNECTOR_PREFIX and sums each pair.
CONNECTOR_PREFIX = "connector_"
SUMMED = ("hits", "preempted_hits")


def summed(engine: dict[str, int | float]) -> dict[str, int | float]:
    """`engine`'s counters plus, for each of `SUMMED`, the device's and the connector's
    together, named "<name>+connector_<name>"."""
    return {**engine, **{f"{n}+{CONNECTOR_PREFIX}{n}":
                         engine.get(n, 0) + engine.get(CONNECTOR_PREFIX + n, 0)
                         for n in SUMMED}}


def counters(base: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """The contract's counters under a host tier: each of `SUMMED` read as the device's
    and the connector's together (`summed`)."""
    return tuple((f"{c}+{CONNECTOR_PREFIX}{c}" if c in SUMMED else c, m) for c, m in base)


# The host-tier rule of each release before 0.33.0 read by hand: 0.33.0's (`HOST_RULE`)
# with its own lines, the host sized from the GPU tensors (`gpu_tensors`) and every load
# asynchronous (its TransferJob has no sync; no sync_load_budget_bytes, 0.30.0-0.32.0
# included: common.py is 0.29.0's, get_num_new_matched_tokens returns
# bool(num_hit_tokens)); 0.27.1's connector and scheduler files are 0.27.0's. Its sizing
# head is offloading/config.py's (0.26.0 on, `_CONFIG_HEAD`) or, before, the CPU spec's
# own (`_SPEC_HEAD`); the rest (`_OLD_TAIL`) is the same text at each release's lines
_CONFIG_HEAD = (
    "kv_connector OffloadingConnector, CPU spec (v1/kv_offload/cpu/spec.py:{spec}): the "
    "host holds cpu_bytes_to_use // round_up(worker_kv_bytes_per_block x "
    "blocks_per_chunk, 4096) chunks, the block's bytes read from kv_cache_config."
    "kv_cache_tensors (offloading/config.py:{bytes}), a chunk one GPU block unless "
    "kv_connector_extra_config sets block_size or blocks_per_chunk; ")
# 0.21.0-0.25.1 (no offloading/config.py): CPUOffloadingSpec.__init__ sizes the host
# itself, with OffloadingSpec's block_size_factor and, 0.23.0 on, BLOCK_SIZE_ALIGNMENT 1
# (`_ALIGNED`; 0.21.0 and 0.22.1 have no such attribute and round nothing, `_UNALIGNED`);
# 0.24.0 on read the first tensor's size alone where the tensors are packed (`_PACKED`),
# before they sum them (`_SUMMED`)
_SPEC_HEAD = (
    "kv_connector OffloadingConnector, CPU spec (v1/kv_offload/cpu/spec.py:{spec}; no "
    "offloading/config.py): the host holds cpu_bytes_to_use // {chunk} chunks "
    "(:{size}), kv_bytes_per_block being the bytes of kv_cache_config.kv_cache_tensors "
    "({tensors}) // kv_cache_config.num_blocks x "
    "world_size; block_size_factor, the GPU blocks in a chunk, is 1 unless "
    "kv_connector_extra_config sets block_size (v1/kv_offload/base.py:{factor}; there is "
    "no blocks_per_chunk); ")
_ALIGNED = ("round_up(kv_bytes_per_block x block_size_factor, BLOCK_SIZE_ALIGNMENT 1 "
            "(:{align}))")
_UNALIGNED = ("(kv_bytes_per_block x block_size_factor) (no BLOCK_SIZE_ALIGNMENT: "
              "nothing rounded)")
_PACKED = "the first one's size if packed, else their sum"
_SUMMED = "their sum"
_OLD_TAIL = (
    "every computed full "
    "chunk{of} is stored at the step that computes it (host_stores), "
    "not on eviction "
    "(offloading/scheduler.py:{store} _build_store_jobs), so the host is inclusive and "
    "the adapter sizes it num_blocks + host_blocks chunks; the lookup (:{lookup} _lookup, "
    "from get_num_new_matched_tokens :{matched}) reports host-resident chunks past the "
    "device prefix as external tokens, always loaded asynchronously "
    "(WAITING_FOR_REMOTE_KVS, :{sync}), and complete only when the worker reports the "
    "job (update_connector_output :{update}, finished_recving); the host evicts its "
    "least recently used chunks not being loaded when a store finds it full "
    "(v1/kv_offload/cpu/policies/lru.py, eviction_policy 'lru'); its events are "
    "BlockStored/BlockRemoved with medium 'CPU'{carry} (offloading/scheduler.py:{events} "
    "take_events, v1/kv_offload/cpu/manager.py)")
_OLD_RULE = _CONFIG_HEAD + _OLD_TAIL
_PROMPT_CHUNKS = " of a request's prompt"  # what a store holds (`host_stores`)
_HASHES = " carrying their hashes alone (host_events)"
_DECODED = ", a decode step's too,"


def _rule(template: str, *, of: str = _PROMPT_CHUNKS, carry: str = "",
          chunk: str = _ALIGNED, tensors: str = _PACKED, **lines: Any) -> str:
    """`template` (a head and `_OLD_TAIL`) at a release's `lines`: its stores within a
    prompt unless `of` says otherwise, its events self-describing unless `carry` says
    they carry hashes alone, and (under `_SPEC_HEAD`) its chunk's bytes aligned and the
    tensors' bytes read packed unless `chunk` and `tensors` say otherwise."""
    align = lines.pop("align", "")  # the alignment's line, where `chunk` names one
    return template.format(of=of, carry=carry, tensors=tensors,
                           chunk=chunk.format(align=align), **lines)


_RULE_0_27 = _rule(_OLD_RULE, spec="77-118", bytes="98-111", store=1023, lookup=631,
                   matched=816, sync=871, update=1280, events=1416)
HOST_RULES = {
    # 0.21.0-0.23.0: the host's events by hash alone; 0.21.0 and 0.22.1 store a decode
    # step's chunks too and size the host unaligned
    "0.21.0": _rule(
        _SPEC_HEAD + _OLD_TAIL, of=_DECODED, carry=_HASHES, chunk=_UNALIGNED,
        tensors=_SUMMED, spec="23-55", size="32-47", factor="367-382", store=598,
        lookup=308, matched=446, sync=489, update=788, events=861),
    "0.22.1": _rule(
        _SPEC_HEAD + _OLD_TAIL, of=_DECODED, carry=_HASHES, chunk=_UNALIGNED,
        tensors=_SUMMED, spec="22-58", size="31-46", factor="372-387", store=650,
        lookup=360, matched=498, sync=541, update=866, events=946),
    "0.23.0": _rule(
        _SPEC_HEAD + _OLD_TAIL, carry=_HASHES, tensors=_SUMMED, spec="27-71", align=25,
        size="41-63", factor="427-442", store=721, lookup=387, matched=537, sync=571,
        update=943, events=1029),
    "0.24.0": _rule(
        _SPEC_HEAD + _OLD_TAIL, spec="60-112", align=32, size="74-104", factor="500-515",
        store=831, lookup=452, matched=636, sync=681, update=1061, events=1203),
    "0.25.1": _rule(
        _SPEC_HEAD + _OLD_TAIL, spec="54-106", align=26, size="68-98", factor="551-566",
        store=844, lookup=464, matched=648, sync=693, update=1078, events=1218),
    "0.26.0": _rule(_OLD_RULE, spec="75-113", bytes="90-103", store=926, lookup=539,
                   matched=720, sync=775, update=1173, events=1310),
    "0.27.0": _RULE_0_27, "0.27.1": _RULE_0_27,
    "0.28.0": _rule(_OLD_RULE, spec="77-118", bytes="98-111", store=1248, lookup=876,
                   matched=936, sync=991, update=1507, events=1643),
    "0.29.0": _rule(_OLD_RULE, spec="94-135", bytes="96-101", store=1322, lookup=876,
                   matched=936, sync=991, update=1584, events=1720),
    "0.30.0": _rule(_OLD_RULE, spec="94-135", bytes="137-147", store=1464, lookup=951,
                   matched=1016, sync=1074, update=1806, events=1942),
    "0.31.0": _rule(_OLD_RULE, spec="94-135", bytes="137-147", store=1501, lookup=963,
                   matched=1036, sync=1094, update=1841, events=1977),
    "0.32.0": _rule(_OLD_RULE, spec="93-134", bytes="137-147", store=1570, lookup=966,
                   matched=1039, sync=1097, update=1910, events=2046),
    "0.33.0": HOST_RULE,
}
READ = tuple(HOST_RULES)  # the releases whose offloading connector was read by hand


def host_rule(version: str) -> str:
    """The host-tier rule of `version`, a release in `READ`, with its own lines (the
    contract's `host_blocks` citation). Raises KeyError on a release not read."""
    return HOST_RULES[version]


# Cached releases whose vLLM has no OffloadingConnector at all (read in the cached
# wheels, 2026-12-02): 0.10.2's has no distributed/kv_transfer/kv_connector/v1/
# offloading_connector.py nor v1/kv_offload/, and its connector factory registers none;
# 0.11.2, the first cached release after it, has both (not read)
NO_CONNECTOR = ("0.10.2",)
FIRST_CONNECTOR = "0.11.2"


def blocked_reason(version: str) -> tuple[str, str]:
    """Why the adapter opens no host tier on `version`, as the contract's citation of
    the option ("options.host_blocks", why): that the release has no OffloadingConnector
    (`NO_CONNECTOR`), else that its connector was not read."""
    read = f"read: {', '.join(READ)}"
    if version in NO_CONNECTOR:
        return ("options.host_blocks",
                "this release has no OffloadingConnector (no distributed/kv_transfer/"
                "kv_connector/v1/offloading_connector.py; the first cached release with "
                f"one is {FIRST_CONNECTOR})")
    return ("options.host_blocks", f"this release's OffloadingConnector was not read ({read})")


def host_chunks(host_blocks: int, num_blocks: int) -> int:
    """The host's chunks for a host tier of `host_blocks` beyond a device pool of
    `num_blocks`: vLLM's host is inclusive (every computed block is stored, so it also
    holds what the device holds), where the protocol's `host_blocks` counts the blocks
    held beyond the device's."""
    return num_blocks + host_blocks


def cpu_bytes(chunks: int, page_bytes: int, alignment: int) -> int:
    """`cpu_bytes_to_use` that gives exactly `chunks` chunks of one GPU block of
    `page_bytes` (the spec's own sizing: bytes // round_up(page_bytes, alignment)).
    Raises ValueError on a count or size below 1."""
    if chunks < 1 or page_bytes < 1 or alignment < 1:
        raise ValueError(f"cpu_bytes: chunks={chunks}, page_bytes={page_bytes}, "
                         f"alignment={alignment} must each be >= 1")
    return chunks * (-(-page_bytes // alignment) * alignment)


def alignment(Spec: Any) -> int:
    """What the CPU spec `Spec` (vLLM's `CPUOffloadingSpec`) rounds a chunk's bytes up
    to: its `BLOCK_SIZE_ALIGNMENT` (0.23.0 on: v1/kv_offload/cpu/spec.py, 0.23.0:25,
    0.24.0:32), else 1: 0.21.0 and 0.22.1 have no such attribute and divide by the
    chunk's bytes as they are (spec.py 0.21.0:42-47, 0.22.1:41-46)."""
    return int(getattr(Spec, "BLOCK_SIZE_ALIGNMENT", 1))


def transfer_config(C: Any, chunks: int, page_bytes: int, alignment: int) -> Any:
    """The `KVTransferConfig` (`C`: vllm.config) of a CPU offloading connector of
    `chunks` chunks of one block of `page_bytes` each, aligned to `alignment`
    (`alignment(CPUOffloadingSpec)`), asking for self-describing host events (a key
    the connector reads from 0.24.0 on; before, no code reads it and its events carry
    their hashes alone: `host_events`)."""
    return C.KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes(chunks, page_bytes,
                                                                 alignment),
                                   # the host's BlockStored carry their tokens and parent
                                   # (offloading/events.py:10-15), else placeholders;
                                   # before 0.24.0 unread (`host_events`)
                                   "self_describing_kv_events": True})


def gpu_tensors(Tensor: Any, page_bytes: int, num_blocks: int, layer: str) -> list[Any]:
    """The GPU allocation of the adapter's one attention layer, as vLLM's
    `KVCacheConfig.kv_cache_tensors` describes it (`Tensor`: its `KVCacheTensor`): one
    tensor of `num_blocks` pages of `page_bytes`, layer-outermost (not packed). No GPU
    allocates it; the host reads its size: before 0.30.0 the offloading config (before
    0.26.0 the CPU spec itself) sizes a block only from these tensors, 0 without them,
    so the host would get no chunk (0.26.0 on, and 0.21.0 and 0.22.1, whose division is
    guarded: v1/kv_offload/cpu/spec.py 0.21.0:42-47, 0.22.1:41-46) or its division by
    the aligned 0 would raise ZeroDivisionError (0.23.0 :41-57, 0.24.0 :74-98, 0.25.1
    :68-92; 0.26.0 offloading/config.py:90-103, 0.27.0 and 0.27.1 :98-111, 0.28.0 :98-111,
    0.29.0 :96-101; 0.30.0-0.32.0 :137-147 and 0.33.0 fall back to the groups' specs,
    :148-151 and :186-189, and read the same bytes here)."""
    size = page_bytes * num_blocks
    if "shared_by" in Tensor.__dataclass_fields__:  # 0.28.0 and before
        return [Tensor(size=size, shared_by=[layer])]
    return [Tensor(size=size, layers=[layer], layer_stride=size, block_stride=page_bytes)]


class WorkerStandIn:
    """The offloading worker, as the adapter runs it: `output(meta)` is the
    `KVConnectorOutput` a worker that finished every job of the step's metadata would
    return, each block a job names written to the harness log by `write` (a store:
    "offload" [device block, host chunk]; a load: "onboard" [host chunk, device block]).
    `Output` and `WorkerMeta` are vLLM's `KVConnectorOutput` and
    `OffloadingWorkerMetadata`. A job's blocks are read from its `src_spec` and
    `dst_spec`, or, on 0.21.0-0.24.0, from its one `transfer_spec` pair (`_pairs`).

    A store copies what its request's KV is in the block, so its log entry waits
    (`pending`) until the log holds that KV and goes before anything that may overwrite
    the block: before the first entry of another request that writes KV (`entry`),
    before a step's loads (the worker flushes and submits stores before it starts loads,
    `offloading/worker.py:219-244`), and at the end of the op (`drain`). A finished or
    preempted request's store that vLLM flushes because its block is reallocated in the
    step (`jobs_to_flush`, copied before the step's forward) is thereby logged before
    the new owner's entry."""

    def __init__(self, Output: Any, WorkerMeta: Any, block_size: int,
                 write: Callable[[dict[str, Any]], None]) -> None:
        self.Output, self.WorkerMeta = Output, WorkerMeta
        self.block_size, self.write = block_size, write
        self.pending: list[tuple[str, dict[str, Any]]] = []  # (request id, "offload" entry)

    def _flush(self, keep: Callable[[str], bool]) -> None:
        """Write the pending stores of the requests `keep` does not hold back, in order."""
        held = []
        for req_id, store in self.pending:
            if keep(req_id):
                held.append((req_id, store))
            else:
                self.write(store)
        self.pending = held

    def entry(self, event: dict[str, Any]) -> None:
        """Log the op's `event`: first the pending stores of other requests, unless it
        is a "free" (which writes no KV); its own request's stay pending (their KV is
        logged by this entry or a later one of the op)."""
        if event["kind"] != "free":
            own = str(event["seq_id"])
            self._flush(lambda req_id: req_id == own)
        self.write(event)

    def drain(self) -> None:
        """Write every pending store (the op is over: its KV is in the log)."""
        self._flush(lambda req_id: False)

    def output(self, meta: Any) -> tuple[Any, set[str]]:
        """The step's connector output and the requests whose loads it finished.
        `meta` is the step's `OffloadingConnectorMetadata` (None: nothing to report)."""
        recv: set[str] = set()
        if meta is None:
            return None, recv
        done = self.WorkerMeta()
        for job_id, job in meta.store_jobs.items():
            done.mark_completed(job_id)
            self.pending += [(job.req_id, self._move("offload", s, d))
                             for s, d in self._pairs(job)]
        if meta.load_jobs:
            loading = {job.req_id for job in meta.load_jobs.values()}
            self._flush(lambda req_id: req_id in loading)
        for job_id, job in meta.load_jobs.items():
            done.mark_completed(job_id)
            # a TransferJob has no sync before 0.33.0 (common.py:53-64): every load
            # there is asynchronous (get_num_new_matched_tokens returns num_hit_tokens,
            # bool(num_hit_tokens): 0.26.0 scheduler.py:775, 0.28.0 and 0.29.0 :991)
            if not getattr(job, "sync", False):
                recv.add(job.req_id)
            for s, d in self._pairs(job):
                self.write(self._move("onboard", s, d))
        return self.Output(finished_recving=recv or None,
                           kv_connector_worker_meta=done if done.completed_jobs else None), recv

    def _move(self, kind: str, src: int, dst: int) -> dict[str, Any]:
        return {"kind": kind, "seq_id": "CACHE", "tokens": [], "num_tokens": self.block_size,
                "block_ids": [src, dst]}

    @staticmethod
    def _pairs(job: Any) -> list[tuple[int, int]]:
        """The (source block, destination block) pairs a `TransferJob` moves: from its
        `src_spec` and `dst_spec` (0.25.1 on: offloading/common.py, 0.25.1:63-64), or
        from 0.21.0-0.24.0's one `transfer_spec`, a (source, destination) `TransferSpec`
        (offloading/common.py, 0.24.0:63, 0.21.0-0.23.0:24; v1/kv_offload/worker/
        worker.py:10). Raises ValueError where the two specs name different counts of
        blocks."""
        src, dst = (job.src_spec, job.dst_spec) if hasattr(job, "src_spec") \
            else job.transfer_spec
        return list(zip(src.block_ids.tolist(), dst.block_ids.tolist(), strict=True))

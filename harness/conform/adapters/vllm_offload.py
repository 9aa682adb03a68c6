"""vLLM's CPU offloading connector under the scheduler adapter (runs in a vLLM venv of a
release in `READ`, 0.24.0-0.33.0): its scheduler side is vLLM's, its worker is the
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
of a host hit (`FULL_HIT`, `LOAD_RESERVE`, cited by `rules`). The releases read differ
in how the host is sized (0.26.0 on: `offloading/config.py`'s chunks; 0.24.0 and
0.25.1: `v1/kv_offload/cpu/spec.py` alone, `_SPEC_HEAD`), where the prompt-only store
cap is (`_calc_num_offloadable_tokens` from 0.26.0, inline in `_build_store_jobs`
before) and in the shape of a transfer job (0.24.0: one `transfer_spec` pair,
`WorkerStandIn._pairs`); the adapter's `cpu_bytes` and `gpu_tensors` give exactly the
chunks asked on each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.conform.protocol import HostFullHit, HostLoadReserve, HostStores

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
# 0.27.0's byte for byte; 0.25.1's two methods and its reserve are 0.24.0's text)
_RULE_LINES = {"0.24.0": (2385, 872, 2348), "0.25.1": (2437, 901, 2400),
               "0.26.0": (2582, 933, 2536), "0.27.0": (2674, 971, 2628),
               "0.27.1": (2674, 971, 2628),
               "0.28.0": (2762, 1031, 2716), "0.29.0": (2855, 1075, 2809),
               "0.30.0": (2958, 1157, 2912), "0.31.0": (3096, 1202, 3032),
               "0.32.0": (3172, 1249, 3088)}


def rules(version: str) -> tuple[tuple[str, str], ...]:
    """The citations of the host hit's two rules (`RULES`) for `version`, with its own
    lines where it is an earlier release whose host tier opens."""
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
STORES_RULES = {
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
# 0.24.0 and 0.25.1 (no offloading/config.py): CPUOffloadingSpec.__init__ sizes the
# host itself, with BLOCK_SIZE_ALIGNMENT 1 and OffloadingSpec's block_size_factor
_SPEC_HEAD = (
    "kv_connector OffloadingConnector, CPU spec (v1/kv_offload/cpu/spec.py:{spec}; no "
    "offloading/config.py): the host holds cpu_bytes_to_use // round_up("
    "kv_bytes_per_block x block_size_factor, BLOCK_SIZE_ALIGNMENT 1 (:{align})) chunks "
    "(:{size}), kv_bytes_per_block being the bytes of kv_cache_config.kv_cache_tensors "
    "(the first one's size if packed, else their sum) // kv_cache_config.num_blocks x "
    "world_size; block_size_factor, the GPU blocks in a chunk, is 1 unless "
    "kv_connector_extra_config sets block_size (v1/kv_offload/base.py:{factor}; there is "
    "no blocks_per_chunk); ")
_OLD_TAIL = (
    "every computed full "
    "chunk of a request's prompt is stored at the step that computes it (host_stores), "
    "not on eviction "
    "(offloading/scheduler.py:{store} _build_store_jobs), so the host is inclusive and "
    "the adapter sizes it num_blocks + host_blocks chunks; the lookup (:{lookup} _lookup, "
    "from get_num_new_matched_tokens :{matched}) reports host-resident chunks past the "
    "device prefix as external tokens, always loaded asynchronously "
    "(WAITING_FOR_REMOTE_KVS, :{sync}), and complete only when the worker reports the "
    "job (update_connector_output :{update}, finished_recving); the host evicts its "
    "least recently used chunks not being loaded when a store finds it full "
    "(v1/kv_offload/cpu/policies/lru.py, eviction_policy 'lru'); its events are "
    "BlockStored/BlockRemoved with medium 'CPU' (offloading/scheduler.py:{events} "
    "take_events, v1/kv_offload/cpu/manager.py)")
_OLD_RULE = _CONFIG_HEAD + _OLD_TAIL
_RULE_0_27 = _OLD_RULE.format(spec="77-118", bytes="98-111", store=1023, lookup=631,
                              matched=816, sync=871, update=1280, events=1416)
HOST_RULES = {
    "0.24.0": (_SPEC_HEAD + _OLD_TAIL).format(
        spec="60-112", align=32, size="74-104", factor="500-515", store=831, lookup=452,
        matched=636, sync=681, update=1061, events=1203),
    "0.25.1": (_SPEC_HEAD + _OLD_TAIL).format(
        spec="54-106", align=26, size="68-98", factor="551-566", store=844, lookup=464,
        matched=648, sync=693, update=1078, events=1218),
    "0.26.0": _OLD_RULE.format(spec="75-113", bytes="90-103", store=926, lookup=539,
                               matched=720, sync=775, update=1173, events=1310),
    "0.27.0": _RULE_0_27, "0.27.1": _RULE_0_27,
    "0.28.0": _OLD_RULE.format(spec="77-118", bytes="98-111", store=1248, lookup=876,
                               matched=936, sync=991, update=1507, events=1643),
    "0.29.0": _OLD_RULE.format(spec="94-135", bytes="96-101", store=1322, lookup=876,
                               matched=936, sync=991, update=1584, events=1720),
    "0.30.0": _OLD_RULE.format(spec="94-135", bytes="137-147", store=1464, lookup=951,
                               matched=1016, sync=1074, update=1806, events=1942),
    "0.31.0": _OLD_RULE.format(spec="94-135", bytes="137-147", store=1501, lookup=963,
                               matched=1036, sync=1094, update=1841, events=1977),
    "0.32.0": _OLD_RULE.format(spec="93-134", bytes="137-147", store=1570, lookup=966,
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

# Cached releases whose OffloadingConnector was read (2026-12-02) and whose host tier
# the protocol cannot state, with what differs from 0.24.0's. Each one's connector
# publishes the host's BlockStored as a placeholder (no offloading/events.py nor
# self_describing_kv_events, 0.24.0 on): the protocol's events carry a block's tokens
# and parent on every medium, and a router cannot place a stored block without them.
# Their TransferJob is 0.24.0's (offloading/common.py:14-24, one transfer_spec) and
# their CPU spec sizes the host from the tensors' summed size (v1/kv_offload/cpu/
# spec.py: 0.23.0 :36-63 as 0.24.0; 0.22.1 :31-46 and 0.21.0 :32-47 with no
# BLOCK_SIZE_ALIGNMENT, which `transfer_config`'s caller reads, and no rounding).
_PLACEHOLDERS = (
    "its connector publishes the host's BlockStored as a placeholder (offloading/"
    "scheduler.py:{events} take_events: parent_block_hash None, token_ids [], block_size "
    "0; no offloading/events.py, no self_describing_kv_events), which a router cannot "
    "place, and the protocol has no way to state a medium whose events carry their "
    "hashes alone{more}")
# 0.21.0 and 0.22.1 also have no offload_prompt_only (nowhere in v1/kv_offload/ nor in
# the connector) and no reserve for the prefills in flight (their Scheduler has no
# _inflight_prefill_reserved_blocks; the admission's allocate_slots passes no
# reserved_blocks): host_stores would be "when-computed", host_load_reserve "none"
_OLDER = ("; also, every computed full block is stored, a decode step's too (no "
          "offload_prompt_only: _build_store_jobs :{store} caps at req.num_tokens alone), "
          "and an asynchronous load is admitted as any admission (no "
          "_inflight_prefill_reserved_blocks: v1/core/sched/scheduler.py:{alloc} passes "
          "no reserved_blocks)")
MISMATCHED = {
    "0.23.0": _PLACEHOLDERS.format(
        events="1029-1048",
        more=" (the rest is 0.24.0's: the store cap inline at :745-748, the two host-hit "
             "rules at v1/core/sched/scheduler.py:2184, :759 and :2143)"),
    "0.22.1": _PLACEHOLDERS.format(events="946-965",
                                   more=_OLDER.format(store="682-685", alloc="721-731")),
    "0.21.0": _PLACEHOLDERS.format(events="861-880",
                                   more=_OLDER.format(store="630-633", alloc="702-712")),
}


def blocked_reason(version: str) -> tuple[str, str]:
    """Why the adapter opens no host tier on `version`, as the contract's citation of
    the option ("options.host_blocks", why): that the release has no OffloadingConnector
    (`NO_CONNECTOR`), what differs where its connector was read and cannot be stated
    (`MISMATCHED`), else that its connector was not read."""
    read = f"read: {', '.join(READ)}"
    if version in NO_CONNECTOR:
        return ("options.host_blocks",
                "this release has no OffloadingConnector (no distributed/kv_transfer/"
                "kv_connector/v1/offloading_connector.py; the first cached release with "
                f"one is {FIRST_CONNECTOR})")
    why = MISMATCHED.get(version)
    if why is not None:
        return ("options.host_blocks",
                f"this release's OffloadingConnector was read and its host tier cannot "
                f"be stated ({read}): {why}")
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


def transfer_config(C: Any, chunks: int, page_bytes: int, alignment: int) -> Any:
    """The `KVTransferConfig` (`C`: vllm.config) of a CPU offloading connector of
    `chunks` chunks of one block of `page_bytes` each."""
    return C.KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes(chunks, page_bytes,
                                                                 alignment),
                                   # the host's BlockStored carry their tokens and parent
                                   # (offloading/events.py:10-15), else placeholders
                                   "self_describing_kv_events": True})


def gpu_tensors(Tensor: Any, page_bytes: int, num_blocks: int, layer: str) -> list[Any]:
    """The GPU allocation of the adapter's one attention layer, as vLLM's
    `KVCacheConfig.kv_cache_tensors` describes it (`Tensor`: its `KVCacheTensor`): one
    tensor of `num_blocks` pages of `page_bytes`, layer-outermost (not packed). No GPU
    allocates it; the host reads its size: before 0.30.0 the offloading config (before
    0.26.0 the CPU spec itself) sizes a block only from these tensors, 0 without them,
    so the host would get no chunk (0.26.0 on) or its division by the aligned 0 would
    raise ZeroDivisionError (0.24.0 v1/kv_offload/cpu/spec.py:74-98, 0.25.1 :68-92;
    0.26.0 offloading/config.py:90-103, 0.27.0 and 0.27.1 :98-111, 0.28.0 :98-111,
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
    `dst_spec`, or, on 0.24.0, from its one `transfer_spec` pair (`_pairs`).

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
        from 0.24.0's one `transfer_spec`, a (source, destination) `TransferSpec`
        (offloading/common.py:63, v1/kv_offload/worker/worker.py:10). Raises ValueError
        where the two specs name different counts of blocks."""
        src, dst = (job.src_spec, job.dst_spec) if hasattr(job, "src_spec") \
            else job.transfer_spec
        return list(zip(src.block_ids.tolist(), dst.block_ids.tolist(), strict=True))

"""vLLM's CPU offloading connector under the scheduler adapter (runs in a vLLM venv,
0.33.0): its scheduler side is vLLM's, its worker is the adapter's.

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
contract's parts are here too: the rule (`HOST_RULE`), where the adapter opens a host
tier (`READ`) and why not elsewhere (`blocked_reason`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WORKER_STUB = (
    "each store and load job in a step's OffloadingConnectorMetadata is reported done in "
    "that step's own KVConnectorOutput (kv_connector_worker_meta.completed_jobs; a load "
    "that is not sync also in finished_recving), so a request waiting for its load "
    "(WAITING_FOR_REMOTE_KVS) is scheduled at the next step of the same op; no KV value "
    "moves: the adapter logs each block a job names as an offload or onboard "
    "(harness.conform.adapters.vllm_offload.WorkerStandIn)",
    "distributed/kv_transfer/kv_connector/v1/offloading/worker.py:246-284 "
    "start_kv_transfers and prepare_store_kv (stores deferred to the next step), "
    ":286-321 get_finished, :323-329 build_connector_worker_meta (0.33.0); the copies "
    "are v1/kv_offload/cpu/gpu_worker.py's (a CUDA stream, vllm._C swap_blocks_batch)",
    "the worker needs a CUDA-alike or XPU GPU (v1/kv_offload/cpu/spec.py:218-220); a "
    "synchronous report is one timing the real worker may take, never a later one")
REPLICATED = (WORKER_STUB,)

# vLLM's host-tier rule (0.33.0), the contract's `host_blocks` citation
HOST_RULE = (
    "kv_connector OffloadingConnector, CPU spec (v1/kv_offload/cpu/spec.py:97-175): the "
    "host holds cpu_bytes_to_use // round_up(page bytes x blocks_per_chunk, 4096) chunks, "
    "a chunk one GPU block unless kv_connector_extra_config sets block_size or "
    "blocks_per_chunk (offloading/config.py:121-157); every computed full chunk is "
    "stored at the step that computes it, not on eviction "
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

READ = ("0.33.0",)  # the releases whose offloading connector was read by hand


def blocked_reason(version: str) -> tuple[str, str]:
    """Why the adapter opens no host tier on `version`, as the contract's citation of
    the option ("options.host_blocks", why)."""
    return ("options.host_blocks",
            f"this release's OffloadingConnector was not read (read: {', '.join(READ)})")


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


class WorkerStandIn:
    """The offloading worker, as the adapter runs it: `output(meta)` is the
    `KVConnectorOutput` a worker that finished every job of the step's metadata would
    return, each block a job names written to the harness log by `write` (a store:
    "offload" [device block, host chunk]; a load: "onboard" [host chunk, device block]).
    `Output` and `WorkerMeta` are vLLM's `KVConnectorOutput` and
    `OffloadingWorkerMetadata`."""

    def __init__(self, Output: Any, WorkerMeta: Any, block_size: int,
                 write: Callable[[dict[str, Any]], None]) -> None:
        self.Output, self.WorkerMeta = Output, WorkerMeta
        self.block_size, self.write = block_size, write
        self.stores: list[dict[str, Any]] = []  # logged by `entry`, around the op's own

    def entry(self, event: dict[str, Any]) -> None:
        """Log the op's own `event` with the stores its steps made: a store of a block
        the event writes after it (its KV exists once the step ran), the others before
        it (computed by an earlier op)."""
        written = set(event.get("block_ids") or ())
        stores, self.stores = self.stores, []
        for store in stores:
            if store["block_ids"][0] not in written:
                self.write(store)
        self.write(event)
        for store in stores:
            if store["block_ids"][0] in written:
                self.write(store)

    def output(self, meta: Any) -> tuple[Any, set[str]]:
        """The step's connector output and the requests whose loads it finished.
        `meta` is the step's `OffloadingConnectorMetadata` (None: nothing to report)."""
        done = self.WorkerMeta()
        recv: set[str] = set()
        if meta is None:
            return None, recv
        for kind, jobs in (("offload", meta.store_jobs), ("onboard", meta.load_jobs)):
            for job_id, job in jobs.items():
                done.mark_completed(job_id)
                if kind == "onboard" and not job.sync:
                    recv.add(job.req_id)
                for s, d in zip(job.src_spec.block_ids.tolist(),
                                job.dst_spec.block_ids.tolist(), strict=True):
                    (self.stores.append if kind == "offload" else self.write)({"kind": kind, "seq_id": "CACHE", "tokens": [],
                                "num_tokens": self.block_size, "block_ids": [s, d]})
        return self.Output(finished_recving=recv or None,
                           kv_connector_worker_meta=done if done.completed_jobs else None), recv

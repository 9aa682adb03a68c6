"""vLLM's own v1 `Scheduler` over its `KVCacheManager`, behind the protocol (a vLLM venv).

Where a release's `Scheduler` constructs on a CPU (a `VllmConfig` on the CPU device, a
text-only model config, `SchedulerConfig`, `CacheConfig`; nothing else), every op that
schedules runs one real scheduler step, `Scheduler.schedule()` then
`Scheduler.update_from_output()` with the step's requests and no sampled tokens, so the
lookup, the allocation, the prefix-cache stats (recorded wherever that release's
scheduler records them), the scheduler's chunking, its preemption of the last running
request when a decode step gets no block, the resumption of a preempted request and the
router events it publishes are vLLM's:

    admit(seq, tokens)     add_request, a step (its token budget: first_chunk, when
                           given); not scheduled -> refused: finish_requests(ABORTED)
    admit(preempted seq)   the same Request queued again (prepend_request), a step:
                           a resumption, counted in the preempted_* stats
    reserve(seq, n)        a step with seq back in Scheduler.running (budget n - done)
    append(seq, tokens)    append_output_token_ids, a step: the scheduler may preempt
                           the last running requests (maybe seq) to fit it
    preempt(seq)           out of Scheduler.running, then Scheduler._preempt_request
    free(seq)              finish_requests(seq, FINISHED_ABORTED)

The adapter keeps each step about one sequence, which the protocol's ops are: a prompt
left partly scheduled waits outside `Scheduler.running` until its `reserve`, and a
preempted request outside the waiting queue until the admit that resumes it (vLLM would
continue or resume them at its next step). That, the model config, and appending the
sampled token are what stays the adapter's (`REPLICATED`, in the contract).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Sequence
from typing import Any

from harness.conform.adapters import vllm_offload
from harness.conform.adapters.vllm import (
    MAX_MODEL_LEN,
    MODULES,
    NUM_KV_HEADS,
    VllmCache,
    VllmNames,
    import_vllm,
    kv_cache_config,
    load_manager,
    normalise_event,
    release_contract,
)
from harness.conform.protocol import (
    Admission,
    CacheOptions,
    CacheUnderTest,
    Contract,
    LoadedEngine,
    OptionName,
    Scope,
    StateRule,
    Stats,
)
from harness.conform.stubs import StubSpec
from harness.conform.versions import parse_version

SCHEDULER_MODULES = ("vllm.v1.core.sched.scheduler", "vllm.config")
PUBLISHER = "kvharness"  # the router events' publisher, the harness's collector


def load(stubs: StubSpec, version: str | None = None) -> LoadedEngine:
    """vLLM's engine: its caches are `SchedulerCache`s where this release's Scheduler
    constructs on a CPU, else `VllmCache`s (the manager alone; their contract lists what
    the adapter replicates); `version` is used where vLLM has no metadata (a source
    tree). Raises ImportError when vLLM's cache modules do not import."""
    got = import_vllm(stubs, version)
    try:
        scheduling = Scheduling(got.names)
        scheduling.version = got.version
        scheduling.build(4, 4, True, CacheOptions())
    except Exception as exc:  # this release's scheduler does not run here: the manager
        return load_manager(got, f"{type(exc).__name__}: {exc}")  # alone, saying why
    try:  # a Mamba group beside the full one, where this release takes the layout
        scheduling.build(4, 4, True, CacheOptions(state_interval=2))
    except Exception as exc:
        scheduling.no_states = f"{type(exc).__name__}: {exc}"

    def configured(num_blocks: int, block_size: int, record: bool,
                   options: CacheOptions) -> CacheUnderTest:
        return SchedulerCache(got.names, scheduling, got.version, num_blocks, block_size,
                              record, options)

    def new(num_blocks: int, block_size: int, record: bool) -> CacheUnderTest:
        return configured(num_blocks, block_size, record, CacheOptions())

    return LoadedEngine("vllm", got.version, got.package_dir, new,
                        MODULES + SCHEDULER_MODULES, got.stubs_served, got.basis, configured)

REPLICATED = (
    ("the model config: a text-only decoder (uses_mrope, uses_xdrope, is_encoder_decoder, "
     "runner_type 'generate', no multimodal inputs, max_model_len, its one layer's KV "
     "heads) with no tokenizer",
     "vllm.config.ModelConfig",
     "building one inspects a model class (the model executor's imports, in a "
     "subprocess); the scheduler reads only these attributes of it"),
    ("a sampled token entering its request (Request.append_output_token_ids), with no "
     "stop checks, and the request's prefill stats taken as the output carrying that "
     "token takes them (Request.take_prefill_stats, where the release has it)",
     "Scheduler.update_from_output (_update_request_with_output, the EngineCoreOutput)",
     "the op names the token; no model samples it, so the step's output carries none"),
    ("a partly scheduled prompt continues at its reserve op: in between the adapter holds "
     "it out of Scheduler.running, at its place",
     "Scheduler.schedule's running loop, which continues it at every step",
     "each op schedules one sequence"),
    ("a preempted request resumes at the admit that resumes it: in between the adapter "
     "holds it out of the waiting queue",
     "Scheduler.schedule's waiting loop, which resumes it at the next step with room",
     "each op schedules one sequence"),
    ("a step's token budget (Scheduler.max_num_scheduled_tokens) is the op's chunk for a "
     "first_chunk admission and a reserve, and the chunk_budget option for every step",
     "SchedulerConfig.max_num_batched_tokens, which sets it",
     "the harness chooses those chunks; a budget below max_num_seqs fails the config's "
     "own check, which a one-request step does not need"),
    ("a preempt op's victim is the named request (out of Scheduler.running, then "
     "_preempt_request)", "Scheduler.schedule's choice of victim (the last running)",
     "the op names the request; a decode step that gets no block still lets the "
     "scheduler choose"),
    ("the router events are collected by the harness's EventPublisher",
     "the configured publisher (zmq or null)", "the harness is the router"))


@dataclasses.dataclass(frozen=True)
class TextModel:
    """What vLLM's scheduler, its structured-output manager and `VllmConfig` read of a
    model config: a text-only decoder of `max_model_len` with no tokenizer. Any other
    attribute is an AttributeError (a release that reads more names it)."""

    max_model_len: int
    uses_mrope: bool = False
    uses_xdrope: bool = False  # 0.29.0 and 0.30.0 read it
    is_encoder_decoder: bool = False
    runner_type: str = "generate"
    is_diffusion: bool = False
    supports_multimodal_inputs: bool = False
    is_multimodal_model: bool = False
    multimodal_config: None = None
    return_sampling_mask: bool = False
    enable_return_routed_experts: bool = False
    skip_tokenizer_init: bool = True
    is_moe: bool = False
    is_hybrid: bool = False
    is_attention_free: bool = False
    architectures: tuple[str, ...] = ()
    use_mla: bool = False  # the offloading connector's config reads these three
    model: str = "kvharness"
    dtype: str = "float16"

    def get_total_num_kv_heads(self) -> int:
        """The KV heads of the model's attention layer, over every tensor-parallel rank
        (one rank here): the kv_cache_config's (`NUM_KV_HEADS`). The offloading
        connector's config compares it with the group's spec where the V1 model runner
        runs (0.28.0 offloading/config.py:150, 0.29.0 :140; 0.33.0's reads it there
        too, behind use_v2_model_runner, which is true there)."""
        return NUM_KV_HEADS


class Scheduling:
    """vLLM's scheduler classes, imported once; `build` makes one scheduler."""

    def __init__(self, v: VllmNames) -> None:
        import inspect

        from vllm import config as C
        from vllm.distributed.kv_events import EventPublisher, EventPublisherFactory
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        self.v = v
        self.C = C
        self.Scheduler = Scheduler
        self.ModelRunnerOutput = ModelRunnerOutput
        self.RequestStatus = RequestStatus
        self.StructuredOutputManager = StructuredOutputManager
        self.version = ""  # set by `load`: where the offloading connector was read
        self.scheduler_params = set(inspect.signature(Scheduler.__init__).parameters)
        # its fields and InitVars (a pydantic dataclass's __init__ takes **kwargs)
        self.config_params = set(C.SchedulerConfig.__dataclass_fields__)
        # where a prompt's partial-tail state is kept: before its last token where the
        # manager retains that checkpoint alone (0.32 on: get_mamba_prefill_checkpoint_
        # position and is_retained_checkpoint), else at its last hash boundary
        from vllm.v1 import kv_cache_interface
        from vllm.v1.core import single_type_kv_cache_manager

        retains = hasattr(kv_cache_interface, "get_mamba_prefill_checkpoint_position") \
            and "is_retained_checkpoint" in inspect.getsource(single_type_kv_cache_manager)
        self.tail_rule: StateRule = "chunk-ends-tail" if retains \
            else "chunk-ends-prompt-tail"
        # why a Mamba group cannot be opened ("" when it can: `load` tries it)
        self.no_states = "" if "mamba_cache_mode" in C.CacheConfig.__dataclass_fields__ \
            else "CacheConfig has no mamba_cache_mode (Mamba prefix caching is 0.15.1's)"

        class Collector(EventPublisher):
            """The router: keeps every batch the scheduler publishes."""

            def __init__(self) -> None:
                super().__init__()
                self.events: list[Any] = []

            def publish(self, events: Any) -> None:
                self.events.extend(events.events)

            def shutdown(self) -> None:
                """Nothing to close."""

        self.Collector = Collector
        self.EventPublisherFactory = EventPublisherFactory
        # vLLM's own way in for a publisher; 0.10.2's "null" publisher cannot take the
        # config's fields, so where the config names publishers freely the scheduler
        # builds this one
        if PUBLISHER not in EventPublisherFactory._registry:
            EventPublisherFactory.register_publisher(
                PUBLISHER, lambda data_parallel_rank=0, **_: Collector())

    def runner_output(self, ids: list[str]) -> Any:
        """What the model runner returns for a step that ran `ids` and sampled nothing:
        no sampled-token list at all, as vLLM's own empty output has it (every release
        reads it as `sampled_token_ids[i] if sampled_token_ids else []`, and 0.11's
        entries are arrays it calls `.tolist()` on); 0.10.2 wants its logprobs and
        pooler fields given."""
        fields = {f.name for f in dataclasses.fields(self.ModelRunnerOutput)}
        given: dict[str, Any] = {
            "req_ids": ids, "req_id_to_index": {r: i for i, r in enumerate(ids)},
            "sampled_token_ids": [], "logprobs": None,
            "prompt_logprobs_dict": {}, "pooler_output": []}
        return self.ModelRunnerOutput(**{k: v for k, v in given.items() if k in fields})

    def build(self, num_blocks: int, block_size: int, record: bool,
              options: CacheOptions) -> tuple[Any, Any]:
        """A fresh `Scheduler` over `num_blocks` blocks and its event collector; with
        `options.state_interval`, a Mamba group beside the full one ("align" mode), the
        scheduler's and the hash's block sizes as vLLM's own
        `resolve_kv_cache_block_sizes` gives them (the LCM and the GCD of the groups'
        blocks). Raises what vLLM raises for a layout it refuses."""
        C = self.C
        if options.state_interval is not None and self.no_states:
            raise ValueError(f"no Mamba group on this release: {self.no_states}")
        if options.host_blocks is not None and self.version not in vllm_offload.READ:
            raise ValueError(f"host_blocks={options.host_blocks}: "
                             f"{vllm_offload.blocked_reason(self.version)[1]}")
        if options.host_blocks is not None and (options.window or options.state_interval):
            raise ValueError(f"host_blocks={options.host_blocks} with a window or a "
                             "state_interval: the adapter opens a host tier over the full "
                             "group alone")
        if options.state_interval is not None and options.window is not None:
            raise ValueError(f"options window={options.window} and state_interval="
                             f"{options.state_interval} together: the adapter opens a "
                             "window group or a Mamba group beside the full one, not both "
                             "(its gauges count one group beside it)")
        wanted = {"max_num_seqs": 1024, "max_num_batched_tokens": MAX_MODEL_LEN,
                  "max_model_len": MAX_MODEL_LEN, "is_encoder_decoder": False,
                  "enable_chunked_prefill": True, "async_scheduling": False,
                  "long_prefill_token_threshold": options.long_prefill_threshold or 0}
        sched = C.SchedulerConfig(**{k: x for k, x in wanted.items()
                                     if k in self.config_params})
        mamba = {} if options.state_interval is None else {"mamba_cache_mode": "align"}
        cache = C.CacheConfig(block_size=block_size, enable_prefix_caching=True, **mamba)
        try:
            events = C.KVEventsConfig(enable_kv_cache_events=record, publisher=PUBLISHER)
        except ValueError:  # the config takes "null" or "zmq" only (0.16.0 on)
            events = C.KVEventsConfig(enable_kv_cache_events=record, publisher="null")
        groups = kv_cache_config(self.v, num_blocks, block_size, options.window,
                                 options.state_interval)
        transfer = {}
        if options.host_blocks is not None:
            from vllm.v1.kv_cache_interface import KVCacheTensor
            from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
            page = groups.kv_cache_groups[0].kv_cache_spec.page_size_bytes
            groups.kv_cache_tensors = vllm_offload.gpu_tensors(
                KVCacheTensor, page, groups.num_blocks,
                groups.kv_cache_groups[0].layer_names[0])
            transfer["kv_transfer_config"] = vllm_offload.transfer_config(
                C, vllm_offload.host_chunks(options.host_blocks, num_blocks), page,
                vllm_offload.alignment(CPUOffloadingSpec))
        config = C.VllmConfig(device_config=C.DeviceConfig(device="cpu"),
                              scheduler_config=sched, cache_config=cache,
                              kv_events_config=events, **transfer)
        config.model_config = TextModel(MAX_MODEL_LEN)
        config.cache_config.num_gpu_blocks = num_blocks + 1
        sched_block = hash_block = block_size
        if options.state_interval is not None:
            resolve = getattr(self.v.utils, "resolve_kv_cache_block_sizes", None)
            if resolve is None:
                raise ValueError("no resolve_kv_cache_block_sizes: this release's scheduler "
                                 "hashes in its own block, which the full group's is not")
            sched_block, hash_block = resolve(groups, config)
        kwargs = {"vllm_config": config, "kv_cache_config": groups,
                  "structured_output_manager": self.StructuredOutputManager(config),
                  "block_size": sched_block, "log_stats": True,
                  "hash_block_size": hash_block}
        scheduler = self.Scheduler(**{k: x for k, x in kwargs.items()
                                      if k in self.scheduler_params})
        collector = scheduler.kv_event_publisher
        if not isinstance(collector, self.Collector):
            collector = scheduler.kv_event_publisher = self.Collector()
        if options.chunk_budget is not None:  # what max_num_batched_tokens would set, but
            # its check wants max_num_seqs requests to fit one step
            scheduler.max_num_scheduled_tokens = options.chunk_budget
        return scheduler, collector


def honoured(options: CacheOptions, no_states: str,
             version: str = "") -> tuple[OptionName, ...]:
    """The options a cache opened with `options` honours beside those set: a window, a
    Mamba group or a host tier, one at a time; no Mamba group where the release opens
    none (`no_states` says why); a host tier only where `version`'s offloading connector
    was read (`vllm_offload.READ`)."""
    apart = (options.window, options.state_interval, options.host_blocks)
    states = () if no_states or any(x is not None for x in apart[::2]) \
        else ("state_interval",)
    window = () if any(x is not None for x in apart[1:]) else ("window",)
    host = ("host_blocks",) if version in vllm_offload.READ \
        and all(x is None for x in apart[:2]) else ()
    return (*window, "chunk_budget", "long_prefill_threshold", *states, *host)


def scheduler_contract(base: Contract, options: CacheOptions, full_prompt: bool,
                       preempt_op: bool, no_states: str = "",
                       hash_block: int | None = None,
                       tail_rule: StateRule = "chunk-ends-tail") -> Contract:
    """`base` (the release's manager-level contract, `release_contract`) as its own
    scheduler drives it; `full_prompt`: its scheduler admits a request only when its
    whole prompt fits (`scheduler_reserve_full_isl`); `preempt_op`: it has
    `_preempt_request` (before, its preemption is written inside `schedule`, which only a
    decode step reaches); `no_states`: why this release opens no Mamba group ("" when it
    does); `hash_block`: the scheduler's hash block under a Mamba group (finer than its
    state block: partial hash hits, so a prompt's tail stop keeps a state too, where
    `tail_rule` says)."""
    states = options.state_interval
    tail = states is not None and hash_block is not None \
        and hash_block < states * base.block_size
    shared = parse_version(base.version).release >= (0, 31)
    host = options.host_blocks
    host_citation = (("host_blocks", vllm_offload.host_rule(base.version)),) \
        if host is not None \
        else () if base.version in vllm_offload.READ \
        else (vllm_offload.blocked_reason(base.version),)
    opts = honoured(options, no_states, base.version)
    rules = "host_blocks" in opts  # the host hit's rules, where a host tier may open
    events = vllm_offload.host_events(base.version)  # what the host's events carry
    return dataclasses.replace(
        base, preemption="frees-keeps-cached" if preempt_op else "none",
        decode_refusal="preempts-last",
        chunking="token-budget-shared" if shared else "token-budget",
        chunk_budget=options.chunk_budget,
        long_prefill_threshold=options.long_prefill_threshold,
        admission_fits="prompt" if full_prompt else "chunk",
        options=opts,
        host_full_hit=vllm_offload.FULL_HIT if rules else "unreused-tail",
        host_load_reserve=vllm_offload.load_reserve(base.version) if rules else "none",
        host_stores=vllm_offload.stores(base.version) if rules else "on-eviction",
        host_events=events[0] if rules else "self-describing",
        window=options.window, window_layout="full-and-window",
        replicated=REPLICATED if host is None else (*REPLICATED, *vllm_offload.REPLICATED),
        host_blocks=host,
        counters=base.counters if host is None else vllm_offload.counters(base.counters),
        state_interval=states,
        state_rule="every-k" if states is None else tail_rule if tail else "chunk-ends",
        citations=(*base.citations,
                   ("decode_refusal", "v1/core/sched/scheduler.py Scheduler.schedule: 'The "
                                      "request cannot be scheduled. Preempt the "
                                      "lowest-priority request.'"),
                   ("preemption", "Scheduler._preempt_request: frees the request's blocks, "
                                  "num_computed_tokens = 0, back to the waiting queue"),
                   ("chunking", "Scheduler.schedule: num_new_tokens capped by "
                                "long_prefill_token_threshold and the token budget (0.31 "
                                "on: 'When it is the only request there is nobody to "
                                "starve', the threshold waits for a second request)"),
                   ("admission_fits", "SchedulerConfig.scheduler_reserve_full_isl: 'checks "
                                      "whether the full input sequence length fits in "
                                      "the KV cache before admitting a new request'"),
                   ("window", "kv_cache_coordinator.py HybridKVCacheCoordinator over a "
                              "FullAttentionSpec and a SlidingWindowSpec group; "
                              "single_type_kv_cache_manager.py SlidingWindowManager: "
                              "blocks before num_computed_tokens - sliding_window + 1 are "
                              "freed at the next allocate_slots"),
                   ("state_rule", "config/cache.py CacheConfig.mamba_cache_mode: 'Only cache "
                                  "the mamba state of the last token of each scheduler "
                                  "step and when the token is at position i * "
                                  "block_size'; Scheduler._mamba_block_aligned_split "
                                  "stops a prompt there (and, with a hash block finer "
                                  "than the state block, at its last hash block before "
                                  "its last token); MambaManager.find_longest_cache_hit "
                                  "takes the rightmost kept state"),
                   *((("options", f"no state_interval: {no_states}"),) if no_states
                     else ()), *host_citation,
                   *(vllm_offload.rules(base.version) if rules else ()),
                   *((("host_stores", vllm_offload.stores_rule(base.version)),) if rules
                     else ()),
                   *((("host_events", events[1]),) if rules and events[1] else ())),
        notes=(*base.notes, "every op that schedules runs Scheduler.schedule and "
                            "update_from_output; stats are read from the step's "
                            "SchedulerStats"))


class SchedulerCache(VllmCache):
    """`CacheUnderTest` over one fresh vLLM `Scheduler` (full attention, one group)."""

    def __init__(self, v: VllmNames, s: Scheduling, version: str, num_blocks: int,
                 block_size: int, record: bool, options: CacheOptions) -> None:
        self.s = s
        self.scheduler, self._collector = s.build(num_blocks, block_size, record, options)
        self._attach(v, self.scheduler.kv_cache_manager, num_blocks, block_size, record)
        self._worker: vllm_offload.WorkerStandIn | None = None
        if options.host_blocks is not None:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
                OffloadingWorkerMetadata,
            )
            from vllm.v1.outputs import KVConnectorOutput
            self._worker = vllm_offload.WorkerStandIn(KVConnectorOutput,
                                                      OffloadingWorkerMetadata,
                                                      block_size, super()._write)
        full = bool(getattr(self.scheduler, "scheduler_reserve_full_isl", False))
        base = release_contract(v, version, block_size, hasattr(self.manager, "evict_blocks"))
        self._contract = scheduler_contract(base, options, full,
                                            hasattr(self.scheduler, "_preempt_request"),
                                            s.no_states,
                                            getattr(self.pool, "hash_block_size", None),
                                            s.tail_rule)
        self._budget = self.scheduler.max_num_scheduled_tokens
        zero = self.manager.make_prefix_cache_stats()
        self._add_stats(zero)  # every counter, at 0
        if self._worker is not None:  # the connector's too, from the start: a counter a
            # step first reports is no change (Scheduler.connector_prefix_cache_stats)
            self._add_stats(zero, vllm_offload.CONNECTOR_PREFIX)
        self._parked: dict[Hashable, Any] = {}  # seq -> its Request, out of running
        self._preempted: dict[Hashable, Any] = {}  # seq -> its Request, out of waiting
        self._victims: list[Hashable] = []  # preempted since take_preempted
        self._order: dict[Hashable, int] = {}  # seq -> when it was (re)admitted
        self._clock = 0

    # -- for the self-test -----------------------------------------------------------------

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every vLLM function the adapter calls."""
        out = super().engine_callables()
        for name in ("get_computed_blocks", "allocate_slots", "free",
                     "record_prefix_cache_stats", "make_prefix_cache_stats"):
            out.pop(name, None)  # the scheduler calls them, not the adapter
        sched = self.scheduler
        out.update({f"Scheduler.{n}": (sched, n) for n in (
            "schedule", "update_from_output", "add_request", "finish_requests",
            "_preempt_request") if hasattr(sched, n)})
        out["Scheduler.__init__"] = (self.s.Scheduler, "__init__")
        out["waiting.prepend_request"] = (sched.waiting, "prepend_request")
        out["waiting.remove_request"] = (sched.waiting, "remove_request")
        return out

    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        """The vLLM functions each op kind calls: a step is Scheduler.schedule and
        update_from_output (a commit calls none: vLLM cached the blocks when its step
        allocated them)."""
        step = ("Scheduler.schedule", "Scheduler.update_from_output")
        out = {"admit": ("Request.__init__", "Scheduler.add_request", *step),
               "reserve": step, "commit": (),
               "append": ("append_output_token_ids", *step),
               "free": ("Scheduler.finish_requests",),
               "evict": ("evict_blocks",) if hasattr(self.manager, "evict_blocks") else ()}
        if hasattr(self.scheduler, "_preempt_request"):
            out["preempt"] = ("Scheduler._preempt_request", "waiting.remove_request")
        return out

    def raw_probe(self) -> dict[str, Any]:
        """vLLM's own results for one admission through a step, freed again."""
        req = self._request("__selftest__", list(range(1, 2 * self.block_size + 2)), None)
        self.scheduler.add_request(req)
        out: dict[str, Any] = {"schedule": self._step(self._budget)}
        out["get_block_ids"] = self.manager.get_block_ids(req.request_id)
        self.scheduler.finish_requests(req.request_id, self.s.RequestStatus.FINISHED_ABORTED)
        out["events"] = self._collector.events
        self.scheduler.reset_prefix_cache()
        self._step(self._budget)
        self._collector.events = []
        self._engine_stats.clear()
        if self._worker is not None:  # the probe's stores are no op's
            self._worker.pending.clear()
        return out

    def _write(self, event: dict[str, Any]) -> None:
        """The op's log entry, with the host stores its steps made (`WorkerStandIn.entry`)."""
        if self._worker is None or event.get("seq_id") == "CACHE":
            super()._write(event)
        else:
            self._worker.entry(event)

    def take_log(self) -> list[dict[str, Any]]:
        """The harness log since the last call, the op's pending host stores last."""
        if self._worker is not None:
            self._worker.drain()
        return super().take_log()

    # -- one scheduler step ----------------------------------------------------------------

    def _step(self, budget: int) -> dict[Hashable, int]:
        """`Scheduler.schedule()` with a token budget of `budget`, then
        `update_from_output()` with no sampled tokens; adds the step's prefix-cache
        stats to the totals. Returns the tokens it scheduled per request."""
        sched = self.scheduler
        sched.max_num_scheduled_tokens = min(budget, self._budget)
        try:
            out = sched.schedule()
        finally:
            sched.max_num_scheduled_tokens = self._budget
        ids = list(out.num_scheduled_tokens)
        runner = self.s.runner_output(ids)
        loaded: set[str] = set()
        if self._worker is not None:
            runner.kv_connector_output, loaded = self._worker.output(
                out.kv_connector_metadata)
        for eco in sched.update_from_output(out, runner).values():
            stats = getattr(eco, "scheduler_stats", None)
            if stats is not None:
                self._add_stats(stats.prefix_cache_stats)
                if self._worker is not None:
                    self._add_stats(stats.connector_prefix_cache_stats,
                                    vllm_offload.CONNECTOR_PREFIX)
        scheduled = dict(out.num_scheduled_tokens)
        if loaded:  # a request that waited for its load runs at the op's next step
            for seq, n in self._step(budget).items():
                scheduled[seq] = scheduled.get(seq, 0) + n
        return scheduled

    def _running_step(self, seq_id: Hashable, budget: int) -> list[Hashable]:
        """A step with `seq_id` in Scheduler.running; parks it again while its prompt
        is partly scheduled. Returns the sequences the step preempted."""
        self._unpark(seq_id)
        before = [r.request_id for r in self.scheduler.running]
        self._step(budget)
        victims = self._take_victims(before)
        req = self._reqs.get(seq_id)
        if req is not None and req.num_computed_tokens < req.num_tokens:
            self._park(seq_id)
        return victims

    def _take_victims(self, running_before: list[str]) -> list[Hashable]:
        """The requests a step preempted, last running first (the order vLLM preempts
        them), each held out of the waiting queue until its resumption."""
        out: list[Hashable] = []
        for seq in reversed(running_before):
            req = self._reqs.get(seq)
            if req is None or req.status != self.s.RequestStatus.PREEMPTED:
                continue
            self.scheduler.waiting.remove_request(req)
            self._forget(seq)
            self._preempted[seq] = req
            out.append(seq)
        self._victims += out
        return out

    def _park(self, seq_id: Hashable) -> None:
        self.scheduler.running.remove(self._reqs[seq_id])
        self._parked[seq_id] = self._reqs[seq_id]

    def _unpark(self, seq_id: Hashable) -> None:
        """Back into Scheduler.running, after every request (re)admitted before it."""
        req = self._parked.pop(seq_id, None)
        if req is None:
            return
        running = self.scheduler.running
        order = self._order[seq_id]
        running.insert(sum(1 for r in running if self._order[r.request_id] < order), req)

    def _forget(self, seq_id: Hashable) -> None:
        self._reqs.pop(seq_id, None)
        self._logged.pop(seq_id, None)
        self._scopes.pop(seq_id, None)
        self._parked.pop(seq_id, None)
        self._order.pop(seq_id, None)

    def _log_victims(self, victims: list[Hashable], but: Hashable | None = None) -> None:
        for victim in victims:
            if victim != but:
                self._write({"kind": "free", "seq_id": victim})

    # -- the protocol ------------------------------------------------------------------------

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        """A new request (or a preempted one again) through one scheduler step; None
        (nothing left queued) when the step did not schedule it."""
        if seq_id in self._reqs:
            raise ValueError(f"admit({seq_id!r}): already live")
        resumed = self._preempted.get(seq_id)
        if resumed is not None:
            if list(resumed.all_token_ids) != list(tokens):
                raise ValueError(f"admit({seq_id!r}): a preempted request resumes with its "
                                 f"{resumed.num_tokens} tokens so far, got {len(tokens)}")
            req = resumed
            self.scheduler.waiting.prepend_request(req)
        else:
            req = self._request(seq_id, tokens, scope)
            self.scheduler.add_request(req)
        scheduled = self._step(self._budget if first_chunk is None else first_chunk)
        if req.request_id not in scheduled:
            if resumed is not None:
                self.scheduler.waiting.remove_request(req)
            else:
                self.scheduler.finish_requests(req.request_id,
                                               self.s.RequestStatus.FINISHED_ABORTED)
            return None
        self._preempted.pop(seq_id, None)
        self._clock += 1
        self._order[seq_id] = self._clock
        self._reqs[seq_id] = req
        self._scopes[seq_id] = self._contract.scope_key(scope)
        if req.num_computed_tokens < req.num_tokens:
            self._park(seq_id)
        ids = self._ids(seq_id)
        hit = req.num_computed_tokens - scheduled[req.request_id]
        self._write({"kind": "admit", "seq_id": seq_id, "tokens": list(tokens),
                     "num_tokens": hit, "scope": self._scopes[seq_id], "block_ids": ids})
        self._logged[seq_id] = hit
        self._implied_commit(seq_id)
        return Admission(hit, tuple(ids), req.num_computed_tokens)

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """A step with the sequence running and a budget of its tokens up to
        `num_tokens`. Returns the tokens scheduled so far (0 when the scheduler preempted
        it instead); None (nothing changed) when the step scheduled none."""
        req = self._reqs[seq_id]
        want = min(num_tokens, req.num_tokens) - req.num_computed_tokens
        if want <= 0:
            return req.num_computed_tokens
        before = len(self._ids(seq_id))
        done = req.num_computed_tokens
        victims = self._running_step(seq_id, want)
        self._log_victims(victims, but=seq_id)
        if seq_id in victims:
            self._write({"kind": "free", "seq_id": seq_id})
            return 0
        if req.num_computed_tokens == done:
            return None
        self._write({"kind": "append", "seq_id": seq_id, "tokens": [],
                     "block_ids": self._ids(seq_id)[before:]})
        self._implied_commit(seq_id)
        return req.num_computed_tokens

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        """Append the tokens to the request, then the steps that schedule them (one
        where the chunk budget allows them all), preempting the last running requests
        (maybe this one) until they fit. Under a
        Mamba group, one token a step, as a decoder samples them: several unscheduled
        output tokens are a resumed request's catch-up prefill to vLLM, which
        `Scheduler._mamba_block_aligned_split` stops at a state checkpoint. Returns the
        blocks allocated for them (none when it preempted this sequence)."""
        steps = [list(tokens)] if self._contract.state_interval is None \
            else [[t] for t in tokens]
        added: list[int | None] = []
        for i, step in enumerate(steps):
            got = self._append_step(seq_id, step)
            if got is None:  # preempted: it resumes with every token appended
                self._preempted[seq_id].append_output_token_ids(
                    [t for rest in steps[i + 1:] for t in rest])
                return ()
            added += got
        return tuple(added)

    def _append_step(self, seq_id: Hashable, tokens: list[int]) -> list[int | None] | None:
        """`tokens` into the request and the steps that schedule them all (more than one
        where the chunk budget is below their count), logged; the blocks they allocated,
        or None when a step preempted this sequence."""
        req = self._reqs[seq_id]
        before = self._ids(seq_id)
        req.append_output_token_ids(tokens)
        # the output that carries a sampled token takes the prefill stats (0.21 on); left
        # on the request, a resumption past its prompt trips 0.21-0.25's assert on them
        take_prefill_stats = getattr(req, "take_prefill_stats", None)
        if take_prefill_stats is not None:
            take_prefill_stats()
        victims = self._running_step(seq_id, len(tokens))
        while seq_id not in victims and req.num_computed_tokens < req.num_tokens:
            done = req.num_computed_tokens
            victims += self._running_step(seq_id, req.num_tokens - done)
            if seq_id not in victims and req.num_computed_tokens == done:
                break  # the scheduler schedules it no further: left to the oracles
        self._log_victims(victims, but=seq_id)
        added = [] if seq_id in victims else self._ids(seq_id)[len(before):]
        self._write({"kind": "append", "seq_id": seq_id, "tokens": tokens,
                     "block_ids": added})
        if seq_id in victims:
            self._write({"kind": "free", "seq_id": seq_id})
            return None
        self._implied_commit(seq_id)
        return list(added)

    def preempt(self, seq_id: Hashable) -> None:
        """`Scheduler._preempt_request` on the sequence (out of Scheduler.running
        first, as the scheduler pops its victim), then the rest of that step, which does
        not schedule it (vLLM preempts inside a step; 0.16.0 asserts that a resumed
        request was not scheduled in the step before): its blocks are freed, computed
        ones stay cached; it waits to be resumed."""
        req = self._reqs[seq_id]
        self._unpark(seq_id)
        self.scheduler.running.remove(req)
        self.scheduler._preempt_request(req, time.monotonic())
        self.scheduler.waiting.remove_request(req)
        self._forget(seq_id)
        self._preempted[seq_id] = req
        self._victims.append(seq_id)
        self._write({"kind": "free", "seq_id": seq_id})
        self._step(self._budget)

    def take_preempted(self) -> list[Hashable]:
        """The sequences preempted since the last call, in order."""
        out, self._victims = self._victims, []
        return out

    def free(self, seq_id: Hashable) -> None:
        """`Scheduler.finish_requests(..., FINISHED_ABORTED)`: its blocks are freed,
        tail first; they stay cached in the free queue."""
        req = self._reqs[seq_id]
        self._unpark(seq_id)
        self.scheduler.finish_requests(req.request_id, self.s.RequestStatus.FINISHED_ABORTED)
        self._forget(seq_id)
        self._write({"kind": "free", "seq_id": seq_id})

    def take_events(self) -> list[dict[str, Any]]:
        """What the scheduler published since the last call, then what the manager holds
        still (an eviction between steps), as the harness's dicts."""
        if not self.record:
            return []
        raw, self._collector.events = self._collector.events, []
        raw += self.manager.take_events()
        return [normalise_event(e, self._contract.event_fields) for e in raw]

    def stats(self) -> Stats:
        """The prefix-cache stats every step's SchedulerStats carried, summed (under a
        host tier also the connector's, `vllm_offload.summed`)."""
        got = self._gauges()
        if self._worker is None:
            return got
        return Stats(vllm_offload.summed(got.engine), got.harness)

    def leak_report(self) -> list[str]:
        """With nothing live: every block still referenced, and any request the scheduler
        still holds that is neither preempted nor live."""
        out = super().leak_report()
        held = set(self.scheduler.requests) - {r.request_id for r in self._preempted.values()}
        if held:
            out.append(f"the scheduler still holds requests {sorted(held)}")
        return out

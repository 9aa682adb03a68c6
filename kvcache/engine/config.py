"""EngineConfig: the engine's options, validated once at construction.

    config = EngineConfig(max_num_tokens=64, attn_backend="flashinfer", device="cuda",
                          dtype=torch.bfloat16, cuda_graph=True)
    engine = Engine("tiny", KvCacheConfig(...), config)
    engine = Engine("tiny", KvCacheConfig(...), max_num_tokens=64)   # the same, as keywords

What can be checked from the options alone is checked here (each value, and the options
that depend on each other: CUDA graphs need the flashinfer backend, a CUDA device and
padded decode batches). What depends on the machine (is CUDA there?) or on the model
(CUDA graphs with recurrent layers, windows, reuse) the Engine checks when it is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from kvcache.attention.base import AttentionBackend
from kvcache.attention.registry import get_backend
from kvcache.core.validate import check_fields, check_int, check_positive_int
from kvcache.storage.layouts import LAYOUTS, KvLayout

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32)
# The dtypes the model and the KV storage run in, by the names a dict form gives them.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                  "bfloat16": torch.bfloat16, "float64": torch.float64}
# Backend constructor arguments the engine passes itself (from the model, the storage and
# the other options): backend_options may not set them.
ENGINE_BACKEND_ARGS = ("storage", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                       "window_left", "graph_batch_sizes")
_FLAGS = ("enable_chunked_prefill", "share_prefixes", "release_outside_window", "cuda_graph",
          "record_events", "kv_events")
_SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed's range


@dataclass(frozen=True)
class EngineConfig:
    """How an Engine schedules, runs and records its steps.

    Scheduling: `max_num_tokens` is the per-step token budget, `max_batch_size` the
    running requests; `enable_chunked_prefill` splits a prompt over steps under the
    budget (off: a request runs whole or waits); `share_prefixes` holds a request back
    while a running one of the same scope still computes the full blocks their prompts
    share, then admits it with reuse (kvcache/engine/prefix_sharing.py).

    The model and its attention: `attn_backend` is a registered backend's name or an
    AttentionBackend subclass (one outside the registry, such as a test's); its
    `backend_options` go to its constructor (e.g. {"kernel_family": "fa2"}), except the
    arguments the engine sets (ENGINE_BACKEND_ARGS). `device` and `dtype` (a torch
    dtype or its name, one of DTYPES) are the model's and the KV storage's; `seed`
    initialises a preset's weights. `layout` ("NHD"/"HND": a K and a V pool per layer;
    "BLHNC": one packed K and V for all layers, block-major) and `page_size` (a divisor
    of the block size: re-paging; None: the block size) shape the KV storage.

    Decode padding and CUDA graphs: `pad_decode` pads decode batches to
    `graph_batch_sizes` as CUDA-graph replay does; `cuda_graph` captures them (it needs
    the flashinfer backend and a CUDA device, and pads: pad_decode=False contradicts it).

    Hybrid and windowed models: `state_snapshot_interval` = k keeps a recurrent-state
    snapshot every k blocks (reuse aligns to them); `release_outside_window` lets the
    cache release a running request's blocks no later token can see and match warm
    prompts by the window (False keeps full-attention bookkeeping).

    Records: `record_events` keeps the cache's admission log (the reuse oracle's input;
    `Engine.admission_log`), `kv_events` the KV-cache events for routers
    (`engine.manager.take_kv_events()`).

    Raises ValueError naming the option and the bad value: a count that is not a
    positive int, a flag that is not a bool, an unknown backend, layout, dtype or
    device, graph batch sizes that are not distinct positive ints, a backend option the
    engine sets, and the cross-option rules above. Values are normalised (numpy ints to
    ints, graph sizes to a sorted tuple, a dtype name to the dtype, the device to its
    string, backend_options to a copy: do not mutate it).
    """

    attn_backend: str | type[AttentionBackend] = "torch"
    max_num_tokens: int = 512
    max_batch_size: int = 16
    enable_chunked_prefill: bool = True
    share_prefixes: bool = True
    state_snapshot_interval: int = 1
    release_outside_window: bool = True
    cuda_graph: bool = False
    pad_decode: bool | None = None
    graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES
    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32
    layout: KvLayout = "NHD"
    page_size: int | None = None
    seed: int = 0
    record_events: bool = True
    kv_events: bool = False
    backend_options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("max_num_tokens", "max_batch_size", "state_snapshot_interval"):
            self._set(name, check_positive_int(getattr(self, name), f"EngineConfig.{name}"))
        if self.page_size is not None:
            self._set("page_size", check_positive_int(self.page_size, "EngineConfig.page_size"))
        self._set("seed", check_int(self.seed, "EngineConfig.seed", 0, _SEED_MAX))
        for name in _FLAGS:
            _check_flag(name, getattr(self, name), none_ok=False)
        _check_flag("pad_decode", self.pad_decode, none_ok=True)
        if self.layout not in LAYOUTS:
            raise ValueError(f"EngineConfig.layout must be one of {LAYOUTS}, got "
                             f"{self.layout!r}")
        self._set("dtype", _dtype(self.dtype))
        self._set("device", _device(self.device))
        self._set("graph_batch_sizes", _graph_sizes(self.graph_batch_sizes))
        self._set("backend_options", _backend_options(self.backend_options))
        self._check_graphs(backend_class(self.attn_backend))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ normalises

    def _check_graphs(self, backend: type[AttentionBackend]) -> None:
        """The cross-option rules of padding and CUDA graphs (`backend`: attn_backend's
        class)."""
        if self.pads_decode and not self.graph_batch_sizes:
            raise ValueError("EngineConfig.graph_batch_sizes is empty, but decode batches are "
                             "padded to its sizes (cuda_graph or pad_decode)")
        if not self.cuda_graph:
            return
        if backend.name != "flashinfer":
            raise ValueError(f"EngineConfig.cuda_graph=True needs attn_backend='flashinfer', "
                             f"got {self.attn_backend!r}")
        if not str(self.device).startswith("cuda"):
            raise ValueError(f"EngineConfig.cuda_graph=True needs a CUDA device, got "
                             f"device={self.device!r}")
        if self.pad_decode is False:
            raise ValueError("EngineConfig.cuda_graph=True replays decode batches padded to "
                             "graph_batch_sizes, but pad_decode=False; leave it None or True")

    @property
    def backend_class(self) -> type[AttentionBackend]:
        """The attention backend's class (attn_backend's, or the registered one it names)."""
        return backend_class(self.attn_backend)

    @property
    def pads_decode(self) -> bool:
        """Whether decode batches are padded to graph_batch_sizes (CUDA graphs pad)."""
        return self.cuda_graph or bool(self.pad_decode)

    def as_dict(self) -> dict[str, Any]:
        """Every option as a plain value: the dtype by name, graph sizes and backend
        options as a list and a dict. JSON-ready when `attn_backend` is a name (a class
        is given as itself). `EngineConfig.from_dict` of it equals this config."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["dtype"] = str(self.dtype).removeprefix("torch.")
        data["graph_batch_sizes"] = list(self.graph_batch_sizes)
        data["backend_options"] = dict(self.backend_options)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "config") -> EngineConfig:
        """Build from a mapping of option names (`as_dict`'s form, any subset; a null
        backend_options, as older records have it, is none). Raises ValueError naming
        the unknown keys, `where` and the known ones, and what the constructor raises
        for a bad value."""
        check_fields(data, cls, where)
        options = dict(data)
        if "backend_options" in options and options["backend_options"] is None:
            options["backend_options"] = {}
        return cls(**options)


def with_options(config: EngineConfig | None, options: Mapping[str, Any],
                 where: str) -> EngineConfig:
    """`config` (None: the defaults) with `options` (keyword arguments of `where`, e.g.
    "Engine") replacing its fields. Raises ValueError when `config` is not an
    EngineConfig, TypeError naming an option that is not an EngineConfig field (and
    listing the fields), and what EngineConfig raises for a bad value."""
    if config is not None and not isinstance(config, EngineConfig):
        raise ValueError(f"{where}: engine_config must be an EngineConfig, got {config!r}")
    check_fields(options, EngineConfig, where, options=True)
    if config is None:
        return EngineConfig(**options)
    return replace(config, **options) if options else config


def backend_class(attn_backend: str | type[AttentionBackend]) -> type[AttentionBackend]:
    """The class `attn_backend` names, or the class itself. Raises ValueError for an
    unknown name (listing the registered ones) or a class that is not an
    AttentionBackend."""
    if not isinstance(attn_backend, type):
        return get_backend(attn_backend)
    if not issubclass(attn_backend, AttentionBackend):
        raise ValueError(f"EngineConfig.attn_backend class {attn_backend.__qualname__} is not "
                         "an AttentionBackend")
    return attn_backend


def _check_flag(name: str, value: object, *, none_ok: bool) -> None:
    if isinstance(value, bool) or (none_ok and value is None):
        return
    allowed = "True, False or None" if none_ok else "True or False"
    raise ValueError(f"EngineConfig.{name} must be {allowed}, got {value!r}")


def _dtype(value: object) -> torch.dtype:
    """`value` (a dtype of DTYPES, or its name) as the torch dtype; ValueError otherwise."""
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    if name in DTYPES:
        return DTYPES[name]
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    raise ValueError(f"EngineConfig.dtype must be one of {', '.join(DTYPES)} (a torch dtype "
                     f"or its name), got {value!r}")


def _device(value: object) -> str:
    """`value` (a torch.device or its string) as the device's string; ValueError otherwise."""
    if not isinstance(value, str | torch.device):
        raise ValueError(f"EngineConfig.device must be a torch.device or a device string "
                         f"such as 'cpu' or 'cuda:0', got {value!r}")
    try:
        return str(torch.device(value))
    except (RuntimeError, ValueError):
        raise ValueError(f"EngineConfig.device={value!r} is not a torch device (such as "
                         "'cpu', 'cuda' or 'cuda:0')") from None


def _graph_sizes(value: object) -> tuple[int, ...]:
    """`value` (an iterable of distinct positive ints) as a sorted tuple; ValueError
    otherwise."""
    try:
        sizes = [check_positive_int(s, "size") for s in value]  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        sizes = None
    if sizes is None or isinstance(value, str) or len(set(sizes)) != len(sizes):
        raise ValueError(f"EngineConfig.graph_batch_sizes must be distinct ints >= 1, got "
                         f"{value!r}")
    return tuple(sorted(sizes))


def _backend_options(value: object) -> dict[str, Any]:
    """`value` (a mapping of keyword names) as a dict of its own (the caller's mapping
    may change); ValueError for another type, a key that is not a str, or an argument
    the engine passes itself."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"EngineConfig.backend_options must be a mapping of str keys, got "
                         f"{value!r}")
    taken = sorted(set(value) & set(ENGINE_BACKEND_ARGS))
    if taken:
        raise ValueError(f"EngineConfig.backend_options sets {taken}, which the engine passes "
                         f"itself ({', '.join(ENGINE_BACKEND_ARGS)}): use the engine's own "
                         "options (page_size, graph_batch_sizes, the model's heads and window)")
    return dict(value)

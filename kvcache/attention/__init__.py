"""Paged attention: metadata, backends and a registry of backends by name.

Importing this package never imports flashinfer: the FlashInfer backend imports it when
constructed, so CPU-only machines can import and test everything else.
"""

from __future__ import annotations

from kvcache.attention.base import AttentionBackend, AttentionOutput
from kvcache.attention.flashinfer import FlashInferBackend
from kvcache.attention.metadata import BlockTable, PagedMetadata, build_metadata
from kvcache.attention.reference import ReferenceBackend
from kvcache.attention.star import StarAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionOutput",
    "BlockTable",
    "FlashInferBackend",
    "PagedMetadata",
    "ReferenceBackend",
    "StarAttentionBackend",
    "backend_names",
    "build_metadata",
    "get_backend",
]

_BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (ReferenceBackend, FlashInferBackend, StarAttentionBackend)
}


def backend_names() -> tuple[str, ...]:
    """Names get_backend accepts, sorted."""
    return tuple(sorted(_BACKENDS))


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; ValueError listing the names otherwise."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; supported: "
                         f"{', '.join(backend_names())}") from None

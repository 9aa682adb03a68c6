"""Attention backends by name: the open set `Engine(attn_backend=...)` chooses from."""

from __future__ import annotations

from kvcache.attention.base import AttentionBackend
from kvcache.attention.flashinfer.backend import FlashInferBackend
from kvcache.attention.reference import ReferenceBackend
from kvcache.attention.star import StarAttentionBackend

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
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend {name!r}; supported: "
                         f"{', '.join(backend_names())}") from None

"""The model: a tiny Llama-style decoder (attention and recurrent layers), its config and
presets, and the HF-format checkpoint loader. Names are exported lazily (the config is
pure Python; the rest needs torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache._lazy import lazy_getattr

if TYPE_CHECKING:
    from kvcache.model.checkpoint import CheckpointError, load_pretrained, save_pretrained
    from kvcache.model.config import PRESETS, ModelConfig, get_preset
    from kvcache.model.transformer import ForwardContext, Transformer

_EXPORTS = {
    "CheckpointError": "kvcache.model.checkpoint",
    "load_pretrained": "kvcache.model.checkpoint",
    "save_pretrained": "kvcache.model.checkpoint",
    "PRESETS": "kvcache.model.config",
    "ModelConfig": "kvcache.model.config",
    "get_preset": "kvcache.model.config",
    "ForwardContext": "kvcache.model.transformer",
    "Transformer": "kvcache.model.transformer",
}
__all__ = [
    "PRESETS",
    "CheckpointError",
    "ForwardContext",
    "ModelConfig",
    "Transformer",
    "get_preset",
    "load_pretrained",
    "save_pretrained",
]
__getattr__ = lazy_getattr(__name__, _EXPORTS)

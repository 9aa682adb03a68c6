"""Hugging Face config.json: parsed into a ModelConfig, and written from one.

Reads model_type "llama", "mistral" (Llama plus a sliding window), "ministral" (Mistral
whose `layer_types` interleave "sliding_attention" and "full_attention" layers) and our own
"kvcache_hybrid" (the Llama layout plus our `layer_types`, for presets with recurrent
layers).
Keys that would change the math (activation, biases, RoPE scaling, quantisation) are
checked; the rest of HF's keys (token ids, dtype, architectures) are metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from kvcache.core.validate import check_int
from kvcache.model.config import MAX_LAYERS, MAX_POSITIONS, LayerType, ModelConfig

CONFIG_FILE = "config.json"
HYBRID_MODEL_TYPE = "kvcache_hybrid"
MODEL_TYPES = ("llama", "mistral", "ministral", HYBRID_MODEL_TYPE)
_DEFAULT_ROPE_THETA = 10000.0  # HF Llama's value when a config names none
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "ministral": 131072,
                          HYBRID_MODEL_TYPE: 4096}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "ministral": "MinistralForCausalLM"}
# Ministral's layer types (HF's names) and ours: a sliding layer uses the model's window.
_MINISTRAL_LAYER_TYPES: dict[str, LayerType] = {"sliding_attention": "attention",
                                                "full_attention": "full_attention"}
# Keys whose value sizes something before any weight is read, and ModelConfig's bounds.
_BOUNDED_KEYS = {"num_hidden_layers": MAX_LAYERS, "max_position_embeddings": MAX_POSITIONS}
# The keys of ModelConfig's positive int fields, checked here under config.json's names
# (num_key_value_heads, not num_kv_heads): the error names what to edit in the file.
_POSITIVE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the key or tensor and file."""


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    """Parse an HF config.json (`path` is the file or its directory) into a ModelConfig.

    Raises FileNotFoundError without the file, CheckpointError (naming the file) for a
    file that is not UTF-8 JSON or holds anything unsupported or out of range.
    """
    file = Path(path) / CONFIG_FILE if Path(path).is_dir() else Path(path)
    return parse_config(read_json(file), file)


def read_json(file: Path) -> dict[str, Any]:
    """The JSON object in `file`. Raises FileNotFoundError, or CheckpointError naming the
    file for one that is not UTF-8, not JSON, or not an object."""
    if not file.is_file():
        what = "a folder, not a file" if file.is_dir() else "no such file"
        raise FileNotFoundError(f"{file}: {what} (an HF checkpoint needs {CONFIG_FILE})")
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def parse_config(raw: dict[str, Any], file: Path) -> ModelConfig:
    """`raw` (read from `file`) as a ModelConfig; raises CheckpointError naming `file`."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{file}: model_type={model_type!r} is not supported; supported: {MODEL_TYPES}"
        )
    _check_supported(raw, file, model_type)
    for key, limit in _BOUNDED_KEYS.items():  # named by their key here, not ModelConfig's
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > limit:
            raise CheckpointError(f"{file}: {key}={value!r} exceeds the limit of {limit}")
    hidden, heads = _require(raw, "hidden_size", file), _require(raw, "num_attention_heads", file)
    layer_types = raw.get("layer_types")
    if layer_types is None:  # absent or null: every layer is the model type's default
        layer_types = []
    if not isinstance(layer_types, list):
        raise CheckpointError(f"{file}: layer_types={layer_types!r} must be a list")
    if model_type == "ministral":
        layer_types = _ministral_layer_types(layer_types, file)
    # Only an absent (or null) key takes the default: a 0 is an error, not "unset".
    kv_heads, head_dim = raw.get("num_key_value_heads"), raw.get("head_dim")
    try:
        for key in _POSITIVE_KEYS:
            if raw.get(key) is not None:
                check_int(raw[key], key, 1)
        if kv_heads is not None and heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads} (grouped-query attention "
                             "needs it)")
        return ModelConfig(
            vocab_size=_require(raw, "vocab_size", file),
            hidden_size=hidden,
            intermediate_size=_require(raw, "intermediate_size", file),
            num_layers=_require(raw, "num_hidden_layers", file),
            num_heads=heads,
            num_kv_heads=heads if kv_heads is None else kv_heads,  # HF: absent means MHA
            head_dim=_derived_head_dim(hidden, heads) if head_dim is None else head_dim,
            rope_theta=_rope_theta(raw, file),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            sliding_window=raw.get("sliding_window"),
            max_position_embeddings=raw.get(
                "max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type]
            ),
            layer_types=tuple(layer_types),
        )
    except CheckpointError:
        raise  # already names the file
    except ValueError as exc:
        raise CheckpointError(f"{file}: {exc}") from exc


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json object HF's loaders (and `parse_config`) read back as `config`."""
    if config.has_recurrent_layers:
        model_type = HYBRID_MODEL_TYPE
    elif "full_attention" in config.layer_types:
        model_type = "ministral"
    else:
        model_type = "llama" if config.sliding_window is None else "mistral"
    raw: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        # Both RoPE forms, so transformers 4.x (rope_theta) and 5.x (rope_parameters) agree.
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if model_type in _ARCHITECTURES:
        raw["architectures"] = [_ARCHITECTURES[model_type]]
    if model_type != "llama":
        raw["sliding_window"] = config.sliding_window
    if model_type == HYBRID_MODEL_TYPE:
        raw["layer_types"] = list(config.layer_types)
    if model_type == "ministral":
        hf_names = {ours: hf for hf, ours in _MINISTRAL_LAYER_TYPES.items()}
        raw["layer_types"] = [hf_names[kind] for kind in config.layer_types]
    return raw


def _ministral_layer_types(layer_types: list[Any], file: Path) -> list[LayerType]:
    """Ministral's `layer_types` (HF's names) as ours; [] keeps the default (every layer
    uses the model's window, if it has one)."""
    ours = []
    for index, kind in enumerate(layer_types):
        if not isinstance(kind, str) or kind not in _MINISTRAL_LAYER_TYPES:
            raise CheckpointError(f"{file}: layer_types[{index}]={kind!r}; model_type "
                                  f"'ministral' takes {tuple(_MINISTRAL_LAYER_TYPES)}")
        ours.append(_MINISTRAL_LAYER_TYPES[kind])
    return ours


def _require(raw: dict[str, Any], key: str, file: Path) -> Any:
    if raw.get(key) is None:
        raise CheckpointError(f"{file}: required key {key!r} is missing")
    return raw[key]


def _derived_head_dim(hidden: Any, heads: Any) -> Any:
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    raise ValueError(
        f"head_dim is absent and hidden_size={hidden!r} / heads={heads!r} is not whole"
    )


def _check_supported(raw: dict[str, Any], file: Path, model_type: str) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{file}: hidden_act={raw['hidden_act']!r}; only 'silu' is supported")
    for key in ("attention_bias", "mlp_bias", "quantization_config"):
        if raw.get(key):
            raise CheckpointError(f"{file}: {key}={raw[key]!r} is not supported")
    if model_type == "llama" and raw.get("sliding_window") is not None:
        raise CheckpointError(
            f"{file}: sliding_window={raw['sliding_window']!r} with model_type 'llama' (HF's "
            "Llama ignores it); use model_type 'mistral' for a sliding window"
        )
    if model_type not in (HYBRID_MODEL_TYPE, "ministral") and "layer_types" in raw:
        raise CheckpointError(f"{file}: layer_types is only read for 'ministral' and "
                              f"{HYBRID_MODEL_TYPE!r}")


def _rope_theta(raw: dict[str, Any], file: Path) -> Any:
    """RoPE base from old top-level `rope_theta` or newer `rope_parameters` (both agree)."""
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        if kind != "default":
            raise CheckpointError(
                f"{file}: rope_scaling={scaling!r} is not supported (only default RoPE)"
            )
    top = raw.get("rope_theta")
    params = raw.get("rope_parameters")
    if params is None:
        return _DEFAULT_ROPE_THETA if top is None else top
    if not isinstance(params, dict):
        raise CheckpointError(f"{file}: rope_parameters={params!r} must be an object")
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise CheckpointError(
            f"{file}: rope_parameters.rope_type={kind!r} is not supported (only 'default')"
        )
    unknown = sorted(set(params) - {"rope_type", "rope_theta"})
    if unknown:
        raise CheckpointError(f"{file}: rope_parameters has unsupported keys {unknown}")
    theta = params.get("rope_theta", top)
    if top is not None and theta != top:
        raise CheckpointError(
            f"{file}: rope_theta={top!r} disagrees with rope_parameters.rope_theta={theta!r}"
        )
    return _DEFAULT_ROPE_THETA if theta is None else theta

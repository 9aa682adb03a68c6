"""ModelConfig: the decoder's shape, validated once, and the named presets."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from kvcache.core.validate import check_int, check_positive_int

LayerType = Literal["attention", "full_attention", "recurrent"]
LAYER_TYPES: tuple[LayerType, ...] = ("attention", "full_attention", "recurrent")
# The layer types that attend (and so need KV storage): "attention" within the model's
# sliding_window if it has one, "full_attention" over every earlier token regardless.
ATTENTION_TYPES: frozenset[LayerType] = frozenset({"attention", "full_attention"})

_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings")  # fmt: skip
# Upper bounds for the fields that size something before any weight is seen: one
# module and a dozen tensor names per layer; lengths up to this in the int32 kv_lens
# and indptr arrays of the attention metadata; token ids the cache's uint32 keys hold.
MAX_LAYERS = 1024  # the deepest published decoders have a few hundred: more is a typo
MAX_POSITIONS = 2**31 - 1
MAX_VOCAB = 2**32
_UPPER_BOUNDS = {"num_layers": MAX_LAYERS, "max_position_embeddings": MAX_POSITIONS,
                 "vocab_size": MAX_VOCAB}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and hyper-parameters of a `Transformer`; validated on construction.

    `head_dim` is explicit (it need not equal hidden_size / num_heads). `sliding_window`
    applies to every "attention" layer: a query at position i sees keys j with
    i - sliding_window < j <= i. A "full_attention" layer ignores it and sees every
    earlier key, as the global layers that models such as Gemma 2/3 and GPT-OSS
    interleave with their sliding-window layers do. `layer_types` defaults to all
    "attention"; a list is accepted and stored as a tuple.

    Raises:
        ValueError: a field has a bad type or value (a non-finite float, a count above
            MAX_LAYERS, MAX_POSITIONS or MAX_VOCAB); the message names field, value and
            limit.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 4096
    layer_types: tuple[LayerType, ...] = ()

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            object.__setattr__(self, name, check_int(getattr(self, name), f"ModelConfig.{name}",
                                                     1, _UPPER_BOUNDS.get(name)))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs it)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim={self.head_dim} must be even (RoPE rotates halves)"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not _is_positive_finite(value):
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive finite number")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(
                f"ModelConfig.tie_word_embeddings={self.tie_word_embeddings!r} must be a bool"
            )
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window", check_positive_int(
                self.sliding_window, "ModelConfig.sliding_window"))
        self._normalise_layer_types()

    def _normalise_layer_types(self) -> None:
        if not isinstance(self.layer_types, tuple | list):
            raise ValueError(f"ModelConfig.layer_types={self.layer_types!r} must be a tuple")
        # object.__setattr__: the dataclass is frozen; this runs once, inside __init__.
        types = tuple(self.layer_types) or ("attention",) * self.num_layers
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_layers:
            raise ValueError(
                f"ModelConfig.layer_types has {len(types)} entries, num_layers={self.num_layers}"
            )
        for index, kind in enumerate(types):
            if kind not in LAYER_TYPES:
                raise ValueError(
                    f"ModelConfig.layer_types[{index}]={kind!r}; expected one of {LAYER_TYPES}"
                )

    @property
    def has_recurrent_layers(self) -> bool:
        """Whether any layer is recurrent (its state cannot be rolled back per token)."""
        return "recurrent" in self.layer_types

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers that call `ForwardContext.attention` (and need KV storage)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in ATTENTION_TYPES)

    @property
    def mixer_types(self) -> tuple[Literal["attention", "recurrent"], ...]:
        """Each layer's mixer: both attention types build the same module and weights
        (only the window they attend with differs), recurrent layers their own."""
        return tuple("attention" if kind in ATTENTION_TYPES else "recurrent"
                     for kind in self.layer_types)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Indices of the layers that use `ForwardContext.recurrent_state`."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "recurrent")

    @property
    def window_left(self) -> int:
        """FlashInfer's `window_left` of the "attention" layers: -1 for full attention,
        else sliding_window - 1 (see `layer_window_left` for any one layer).

        The -1 is FlashInfer's own convention, kept so it can be passed straight through.
        """
        return -1 if self.sliding_window is None else self.sliding_window - 1

    def layer_window_left(self, layer: int) -> int:
        """The `window_left` attention layer `layer` (a model layer index) attends with:
        -1 for a "full_attention" layer, else the model's. Raises ValueError for a layer
        that does not attend."""
        kind = self.layer_types[layer]
        if kind not in ATTENTION_TYPES:
            raise ValueError(f"ModelConfig.layer_window_left: layer {layer} is {kind!r}, "
                             "not an attention layer")
        return -1 if kind == "full_attention" else self.window_left

    @property
    def shared_window(self) -> int | None:
        """The window every attention layer attends within: `sliding_window` unless some
        layer is "full_attention" (which needs every earlier key), then None. A cache may
        release blocks outside this window, never outside a narrower one."""
        if "full_attention" in self.layer_types:
            return None
        return self.sliding_window


def _is_positive_finite(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return value > 0 and math.isfinite(value)  # NaN fails both
    except OverflowError:  # an int too large for a float
        return False


_TINY = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    # 64, not hidden/heads = 32: FlashInfer's prefill kernels dispatch head_dim in {64, 128,
    # 256, ...}, and the same presets run on GPU.
    head_dim=64,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    "tiny-tied": dataclasses.replace(_TINY, tie_word_embeddings=True),
    "tiny-swa": dataclasses.replace(_TINY, sliding_window=32),
    "hybrid-tiny": dataclasses.replace(
        _TINY, layer_types=("attention", "recurrent", "attention", "attention")
    ),
    # Recurrent layers beside sliding-window attention (RecurrentGemma's kind of model).
    "hybrid-tiny-swa": dataclasses.replace(
        _TINY, sliding_window=32,
        layer_types=("attention", "recurrent", "attention", "attention")
    ),
    # Windowed layers interleaved with full ones, Gemma 2's pattern (window first).
    "tiny-mixed-swa": dataclasses.replace(
        _TINY, sliding_window=32,
        layer_types=("attention", "full_attention", "attention", "full_attention")
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Return the preset called `name`; raises ValueError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None

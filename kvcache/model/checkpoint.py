"""Hugging Face-format checkpoints: config.json plus *.safetensors, read and written.

Reads model_type "llama" and "mistral" (Llama plus a sliding window). Our presets are
written in the same format; hybrid presets (with recurrent layers) have no HF
architecture and are written as model_type "kvcache_hybrid": the Llama layout plus
`layer_types` and `model.layers.N.recurrence.*` tensors, readable only here.

config.json itself is read and written by `kvcache.model.hf_config`.

Weights are read with safetensors only. Pickle-based files (*.bin, *.pt) are refused:
unpickling runs arbitrary code. Nothing is sized from config.json before it is checked
against the tensor headers present (the depth first: a layer count sizes the rest).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from kvcache.model.config import ModelConfig
from kvcache.model.hf_config import CONFIG_FILE, CheckpointError, hf_config, load_config, read_json
from kvcache.model.transformer import Transformer

__all__ = ["CheckpointError", "load_config", "load_pretrained", "save_pretrained"]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")

# safetensors dtype codes we accept; ints, fp8 and f64 are refused.
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Older HF Llama exports saved this non-learned RoPE buffer; it carries no information.
_IGNORED_SUFFIX = "rotary_emb.inv_freq"

# HF name -> our name, per layer kind, relative to model.layers.N. / layers.N.
_COMMON_RENAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
_MIXER_RENAMES = {
    "attention": {"self_attn.o_proj.weight": "mixer.wo.weight"},
    "recurrent": {
        "recurrence.in_proj.weight": "mixer.win.weight",
        "recurrence.out_proj.weight": "mixer.wo.weight",
        "recurrence.decay": "mixer.decay",
    },
}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def load_pretrained(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    check_finite: bool = True,
) -> Transformer:
    """Build a Transformer from an HF checkpoint (config.json + *.safetensors).

    `path` is the checkpoint folder or its config.json (read as that folder). Every
    tensor header is checked before any tensor is read: all problems (missing,
    unexpected, wrong shape, non-float dtype) are reported together, each naming tensor
    and file. With `check_finite`, every tensor is then checked for NaN and infinite
    values after the cast to `dtype` (one min/max reduction per tensor; an overflow of
    the cast counts too); pass False to skip that pass on trusted weights.
    Raises CheckpointError, FileNotFoundError, or ValueError for a non-float `dtype`.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"load_pretrained(dtype={dtype}): expected a floating dtype")
    directory = _checkpoint_folder(Path(path))
    config = load_config(directory)
    stored = _scan(_weight_files(directory))
    _check_depth(directory, stored, config)
    _validate(directory, stored, config)
    hf = _read_tensors(stored, dtype, device, check_finite)
    # Some exports store a tied head anyway; accept it only if it equals the embedding.
    head = hf.pop("lm_head.weight", None) if config.tie_word_embeddings else None
    if head is not None and not torch.equal(head, hf["model.embed_tokens.weight"]):
        raise CheckpointError(
            f"{stored['lm_head.weight'].file}: tie_word_embeddings is true but lm_head.weight "
            "differs from model.embed_tokens.weight"
        )
    with torch.device("meta"):  # no allocation or init: every tensor is assigned below
        model = Transformer(config, seed=None)
    model.load_state_dict(_to_ours(hf, config), strict=True, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter by two
    return model


def save_pretrained(model: Transformer, path: str | os.PathLike[str]) -> None:
    """Write `model` as config.json + model.safetensors in `path` (created if needed)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config
    dtype = model.tok_embeddings.weight.dtype
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config(config, dtype), indent=2) + "\n")
    save_file(_to_hf(model), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def _checkpoint_folder(path: Path) -> Path:
    """The folder `path` names: itself, or the folder of a config.json."""
    if path.is_dir():
        return path
    if path.is_file() and path.name == CONFIG_FILE:
        return path.parent  # unambiguous: the weights are found beside it
    if path.exists():
        raise CheckpointError(f"{path}: expected a checkpoint folder or its {CONFIG_FILE}, "
                              "got another file")
    raise FileNotFoundError(f"{path}: no such checkpoint folder")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        # Some repositories hold extra safetensors (e.g. consolidated.safetensors in another
        # naming scheme); the index says which files make up the HF model.
        names = _index_files(index)
        files = [directory / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists files that do not exist or are not "
                                  f"regular files: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{directory}: only pickle-based weights {pickles}; refusing to unpickle "
            "(convert them to safetensors)"
        )
    raise FileNotFoundError(f"{directory}: no *.safetensors weight files")


def _index_files(index: Path) -> list[str]:
    """The file names an index's weight_map maps tensors to, each a plain file name."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: missing or malformed 'weight_map'")
    bad = {name: file for name, file in weight_map.items() if not isinstance(file, str)}
    if bad:
        shown = dict(list(bad.items())[:3])
        more = f" and {len(bad) - len(shown)} more" if len(bad) > len(shown) else ""
        raise CheckpointError(f"{index}: weight_map values must be file names (strings), "
                              f"got {shown}{more}")
    names = sorted(set(weight_map.values()))
    outside = [n for n in names if Path(n).name != n]
    if outside:  # only plain file names: an index never reaches outside its folder
        raise CheckpointError(f"{index}: weight_map names files outside the checkpoint "
                              f"folder: {outside}")
    return names


class _Stored(NamedTuple):
    """Where a tensor lives and what its safetensors header says (nothing loaded yet)."""

    file: Path
    shape: list[int]
    dtype: str  # safetensors code: "F32", "BF16", "I64", ...


def _scan(files: list[Path]) -> dict[str, _Stored]:
    stored: dict[str, _Stored] = {}
    for file in files:
        if not file.is_file():  # a folder named *.safetensors
            raise CheckpointError(f"{file}: a folder, not a safetensors file")
        try:
            handle = safe_open(file, framework="pt")
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file: {exc}") from exc
        with handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name in stored:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {stored[name].file} and {file}"
                    )
                view = handle.get_slice(name)
                stored[name] = _Stored(file, list(view.get_shape()), view.get_dtype())
    return stored


def _check_depth(directory: Path, stored: dict[str, _Stored], config: ModelConfig) -> None:
    """Compare num_hidden_layers with the layers the weights hold, before anything is sized
    by it (a tensor list per layer, a module per layer)."""
    present = {int(m.group(1)) for name in stored if (m := _LAYER.match(name))}
    depth = max(present) + 1 if present else 0
    if config.num_layers > depth:
        files = sorted({str(s.file) for s in stored.values()})
        held = {0: "no layers", 1: "only layer 0"}.get(depth, f"layers 0 to {depth - 1}")
        raise CheckpointError(f"{directory / CONFIG_FILE}: num_hidden_layers={config.num_layers}"
                              f", but the weights in {files} hold {held}")


def _read_tensors(stored: dict[str, _Stored], dtype: torch.dtype, device: str | torch.device,
                  check_finite: bool) -> dict[str, Tensor]:
    """Every stored tensor except ignored buffers, cast to `dtype` on `device`. Raises
    CheckpointError listing each tensor with NaN or infinite values when `check_finite`."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, s in stored.items():
        if not name.endswith(_IGNORED_SUFFIX):
            by_file[s.file].append(name)
    hf: dict[str, Tensor] = {}
    problems = []
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="pt") as handle:
            for name in names:
                tensor = handle.get_tensor(name).to(device=device, dtype=dtype)
                if check_finite and not _is_finite(tensor):
                    nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
                    problems.append(f"tensor {name!r} in {file}: {nan} NaN and {inf} infinite "
                                    f"values (read as {dtype})")
                hf[name] = tensor
    if problems:
        raise CheckpointError("non-finite weights (load with check_finite=False to skip this "
                              "check):\n  " + "\n  ".join(problems))
    return hf


def _is_finite(tensor: Tensor) -> bool:
    # One reduction: min and max are NaN if any value is, and +-inf bound any infinity.
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _validate(directory: Path, stored: dict[str, _Stored], config: ModelConfig) -> None:
    expected = _hf_shapes(config)
    if config.tie_word_embeddings:  # allowed, not required: see load_pretrained
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    files = sorted({str(s.file) for s in stored.values()})
    problems = [
        f"tensor {name!r} is missing: expected shape {list(shape)} in {files}"
        for name, shape in expected.items()
        if name not in stored and not (name == "lm_head.weight" and config.tie_word_embeddings)
    ]
    for name, (file, shape, dtype) in stored.items():
        if name.endswith(_IGNORED_SUFFIX):
            continue
        if name not in expected:
            problems.append(f"tensor {name!r} in {file} is unexpected for this config")
            continue
        if shape != list(expected[name]):
            problems.append(
                f"tensor {name!r} in {file}: expected shape {list(expected[name])}, got {shape}"
            )
        if dtype not in _FLOAT_DTYPES:
            problems.append(
                f"tensor {name!r} in {file}: expected dtype one of {sorted(_FLOAT_DTYPES)}, "
                f"got {dtype}"
            )
    if problems:
        raise CheckpointError(
            f"{directory}: weights do not match {CONFIG_FILE}:\n  " + "\n  ".join(problems)
        )


def _hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor a checkpoint of `config` must hold."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    mixer_shapes: dict[str, dict[str, tuple[int, ...]]] = {
        "attention": {
            "self_attn.q_proj.weight": (q_size, hidden),
            "self_attn.k_proj.weight": (kv_size, hidden),
            "self_attn.v_proj.weight": (kv_size, hidden),
            "self_attn.o_proj.weight": (hidden, q_size),
        },
        "recurrent": {
            "recurrence.in_proj.weight": (hidden, hidden),
            "recurrence.out_proj.weight": (hidden, hidden),
            "recurrence.decay": (hidden,),
        },
    }
    for layer, kind in enumerate(config.mixer_types):
        layer_shapes = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        } | mixer_shapes[kind]
        shapes |= {f"model.layers.{layer}.{name}": shape for name, shape in layer_shapes.items()}
    return shapes


def _to_ours(hf: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    ours = {our: hf[name] for name, our in _GLOBAL_RENAMES.items() if name in hf}
    if config.tie_word_embeddings:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    for layer, kind in enumerate(config.mixer_types):
        prefix = f"model.layers.{layer}."
        for name, our in (_COMMON_RENAMES | _MIXER_RENAMES[kind]).items():
            ours[f"layers.{layer}.{our}"] = hf[prefix + name]
        if kind == "attention":
            qkv = [hf[prefix + name] for name in _QKV]
            ours[f"layers.{layer}.mixer.wqkv.weight"] = torch.cat(qkv)  # [q + 2 kv, hidden]
    return ours


def _to_hf(model: Transformer) -> dict[str, Tensor]:
    config = model.config
    # clone(): safetensors refuses views and tensors that share storage (tied, split qkv).
    ours = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    hf = {name: ours[our].clone() for name, our in _GLOBAL_RENAMES.items()}
    if config.tie_word_embeddings:
        del hf["lm_head.weight"]  # HF omits the tied head
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    for layer, kind in enumerate(config.mixer_types):
        prefix = f"model.layers.{layer}."
        for name, our in (_COMMON_RENAMES | _MIXER_RENAMES[kind]).items():
            hf[prefix + name] = ours[f"layers.{layer}.{our}"].clone()
        if kind == "attention":
            parts = ours[f"layers.{layer}.mixer.wqkv.weight"].split([q_size, kv_size, kv_size])
            hf |= {prefix + name: part.clone() for name, part in zip(_QKV, parts, strict=True)}
    return hf

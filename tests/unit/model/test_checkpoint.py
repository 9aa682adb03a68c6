"""HF-format checkpoints: parity with transformers' Llama/Mistral/Ministral, our own round
trip, and clear refusals of checkpoints we cannot load."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from kvcache import Engine, KvCacheConfig
from kvcache.attention.layer_windows import LayerWindows
from kvcache.model import PRESETS, ModelConfig, Transformer, get_preset
from kvcache.model.checkpoint import CheckpointError, load_config, load_pretrained, save_pretrained

if TYPE_CHECKING:
    from transformers import LlamaConfig, MinistralConfig, MistralConfig, PreTrainedModel


def hf_lib() -> ModuleType:
    """transformers, imported when a test first needs it: importing it takes seconds, which
    every collection of this file (each pre-merge run, each xdist worker) would pay."""
    import transformers

    return transformers

HF_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    # A non-default base, so a loader that ignored it would fail parity.
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "attn_implementation": "eager",
}


class FullContext:
    """Recomputes the whole sequence each call: causal (plus window) SDPA, no cache."""

    def __init__(self, config: ModelConfig, length: int) -> None:
        self.config = config
        self.seq_lens = [length]

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        pos = torch.arange(q.shape[0])
        allowed = pos[None, :] <= pos[:, None]  # [T, T]: key j <= query i
        window_left = self.config.layer_window_left(layer)
        if window_left >= 0:
            allowed &= pos[:, None] - pos[None, :] <= window_left
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), allowed, enable_gqa=True
        )  # [Hq, T, D]
        return out.transpose(0, 1)

    def recurrent_state(self, layer: int) -> Tensor:
        return torch.zeros(1, self.config.hidden_size)

    def set_recurrent_state(self, layer: int, state: Tensor, token_states: Tensor) -> None:
        """Discarded: every call recomputes the sequence from its start."""


def logits(model: Transformer, ids: list[int]) -> Tensor:
    ctx = FullContext(model.config, len(ids))
    return model(torch.tensor(ids), torch.arange(len(ids)), ctx)


def greedy(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def random_hf(cls: type[PreTrainedModel],
              config: LlamaConfig | MistralConfig | MinistralConfig) -> PreTrainedModel:
    """An HF model with every weight random, norms included (HF inits them to 1, which would
    hide swapped norms), scaled so the logits spread and ties are unlikely."""
    torch.manual_seed(0)
    model = cls(config).eval().requires_grad_(False)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape) * (0.1 if name.endswith("norm.weight") else 0.15)
        param.copy_(noise + 1 if name.endswith("norm.weight") else noise)
    return model


def prompt(n: int, vocab: int = 128, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(model: PreTrainedModel, ids: list[int]) -> Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


@pytest.fixture(scope="session")
def hf_llama() -> PreTrainedModel:
    return random_hf(hf_lib().LlamaForCausalLM, hf_lib().LlamaConfig(**HF_SHAPE))


@pytest.fixture
def llama_dir(tmp_path: Path, hf_llama: PreTrainedModel) -> Path:
    hf_llama.save_pretrained(tmp_path)
    return tmp_path


def rope_to_top_level(raw: dict[str, Any]) -> None:
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]


@pytest.mark.parametrize(
    "rope_edit",
    [pytest.param(None, id="rope-parameters"), pytest.param(rope_to_top_level, id="rope-theta")],
)
def test_llama_parity(
    llama_dir: Path, hf_llama: PreTrainedModel, rope_edit: Callable[[dict[str, Any]], None] | None
) -> None:
    if rope_edit is not None:
        edit_json(llama_dir / "config.json", rope_edit)
    model = load_pretrained(llama_dir).requires_grad_(False)
    assert model.config.rope_theta == 1000.0
    ids = prompt(20)
    torch.testing.assert_close(logits(model, ids), hf_logits(hf_llama, ids), atol=1e-4, rtol=0)
    expected = hf_llama.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8)
    assert greedy(model, ids, 8) == expected[0, len(ids) :].tolist()


def test_mistral_sliding_window_parity(tmp_path: Path) -> None:
    hf = random_hf(hf_lib().MistralForCausalLM, hf_lib().MistralConfig(**HF_SHAPE, sliding_window=8))
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path).requires_grad_(False)
    assert (model.config.sliding_window, model.config.window_left) == (8, 7)
    ids = prompt(24)  # three windows long, so the window changes the logits
    torch.testing.assert_close(logits(model, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


# Ministral interleaves windowed and full layers; the window is 8 and prompts are 3x it.
MINISTRAL_LAYERS = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]


def test_ministral_mixed_windows_parity(tmp_path: Path) -> None:
    """HF's Ministral masks each layer by its own type: our loader maps its layer types,
    and both the dense forward and the paged engine (one backend per window, warm after
    cold) give HF's logits."""
    # head_dim explicit: HF's Ministral attention reads it raw (None when left to derive).
    config = hf_lib().MinistralConfig(**(HF_SHAPE | {"num_hidden_layers": 4, "head_dim": 16}),
                             sliding_window=8, layer_types=MINISTRAL_LAYERS)
    hf = random_hf(hf_lib().MinistralForCausalLM, config)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path).requires_grad_(False)
    assert model.config.layer_types == ("attention", "full_attention", "full_attention",
                                        "attention")
    assert [model.config.layer_window_left(i) for i in range(4)] == [7, -1, -1, 7]
    ids = prompt(24)
    expected = hf_logits(hf, ids)
    torch.testing.assert_close(logits(model, ids), expected, atol=1e-4, rtol=0)
    engine = Engine(model, KvCacheConfig(tokens_per_block=4, max_num_blocks=32),
                    max_num_tokens=10)
    assert isinstance(engine.backend, LayerWindows)
    for _ in range(2):  # cold, then warm over the cached prefix
        out = engine.generate([ids[:-1]], 1, force_tokens=[[ids[-1]]])[0]
        assert out.logits is not None
        torch.testing.assert_close(out.logits[0], expected[-2], atol=1e-4, rtol=0)
    assert out.num_cached_tokens == 22
    raw = json.loads((tmp_path / "config.json").read_text())
    save_pretrained(model, tmp_path / "ours")
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (ours["model_type"], ours["layer_types"], ours["sliding_window"]) == (
        "ministral", raw["layer_types"], 8)


@pytest.mark.parametrize(("layer_types", "match"), [
    pytest.param(["sliding_attention", "attention"], r"layer_types\[1\]='attention'; model_type "
                 r"'ministral' takes \('sliding_attention', 'full_attention'\)", id="our-name"),
    pytest.param(["full_attention"], r"layer_types has 1 entries, num_layers=2", id="length"),
])
def test_ministral_bad_layer_types(llama_dir: Path, layer_types: list[str], match: str) -> None:
    def edit(raw: dict[str, Any]) -> None:
        raw.update(model_type="ministral", sliding_window=8, layer_types=layer_types)

    edit_json(llama_dir / "config.json", edit)
    with pytest.raises(CheckpointError, match=match):
        load_config(llama_dir)


def test_tied_and_sharded_parity(tmp_path: Path) -> None:
    hf = random_hf(hf_lib().LlamaForCausalLM, hf_lib().LlamaConfig(**HF_SHAPE, tie_word_embeddings=True))
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    # A stray file outside the index (repositories ship such) must not be read.
    save_file({"unrelated": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    model = load_pretrained(tmp_path).requires_grad_(False)
    assert model.output.weight is model.tok_embeddings.weight
    ids = prompt(16)
    torch.testing.assert_close(logits(model, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(PRESETS))
def test_save_load_round_trip(tmp_path: Path, name: str) -> None:
    model = Transformer(PRESETS[name], seed=3).requires_grad_(False)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path).requires_grad_(False)
    assert loaded.config == model.config
    original, restored = model.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original)
    assert torch.equal(logits(loaded, prompt(12, 512)), logits(model, prompt(12, 512)))


@pytest.mark.parametrize("name", ["tiny", "tiny-tied", "tiny-swa", "tiny-mixed-swa"])
def test_saved_presets_load_in_transformers(tmp_path: Path, name: str) -> None:
    model = Transformer(PRESETS[name], seed=4).requires_grad_(False)
    save_pretrained(model, tmp_path)
    hf = hf_lib().AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = prompt(40, 512)
    torch.testing.assert_close(logits(model, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_load_casts_to_requested_dtype(llama_dir: Path) -> None:
    model = load_pretrained(llama_dir, dtype=torch.bfloat16).requires_grad_(False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert logits(model, prompt(8)).dtype == torch.float32
    with pytest.raises(ValueError, match=r"dtype=torch\.int32"):
        load_pretrained(llama_dir, dtype=torch.int32)


WEIGHTS = "model.safetensors"
UP_PROJ = "model.layers.1.mlp.up_proj.weight"


def drop_up_proj(tensors: dict[str, Tensor]) -> None:
    del tensors[UP_PROJ]


def add_bias(tensors: dict[str, Tensor]) -> None:
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)


def shrink_k_proj(tensors: dict[str, Tensor]) -> None:
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)


def int_norm(tensors: dict[str, Tensor]) -> None:
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int64)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        pytest.param(drop_up_proj, rf"'{UP_PROJ}' is missing: expected shape \[128, 64\]", id="missing"),
        pytest.param(add_bias, r"'model.layers.0.self_attn.q_proj.bias' in .*model.safetensors is unexpected", id="unexpected"),
        pytest.param(shrink_k_proj, r"k_proj.weight' in .*model.safetensors: expected shape \[32, 64\], got \[16, 64\]", id="shape"),
        pytest.param(int_norm, r"'model.norm.weight' in .*: expected dtype one of \['BF16', 'F16', 'F32'\], got I64", id="dtype"),
    ],
)  # fmt: skip
def test_load_rejects_bad_tensors(
    llama_dir: Path, edit: Callable[[dict[str, Tensor]], None], match: str
) -> None:
    tensors = load_file(llama_dir / WEIGHTS)
    edit(tensors)
    save_file(tensors, str(llama_dir / WEIGHTS))
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(llama_dir)


def test_load_rejects_tied_head_that_differs(tmp_path: Path) -> None:
    save_pretrained(Transformer(PRESETS["tiny-tied"], seed=0), tmp_path)
    tensors = load_file(tmp_path / WEIGHTS)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, str(tmp_path / WEIGHTS))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight differs from model\.embed_tokens"):
        load_pretrained(tmp_path)


def set_key(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw[key] = value

    return edit


def set_rope_theta(theta: float) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["rope_parameters"]["rope_theta"] = theta

    return edit


def set_rope_type(raw: dict[str, Any]) -> None:
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0}


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        pytest.param(set_key("model_type", "gpt2"), "model_type='gpt2' is not supported", id="model-type"),
        pytest.param(set_rope_type, "rope_parameters.rope_type='llama3' is not supported", id="rope-type"),
        pytest.param(set_key("rope_scaling", {"type": "linear", "factor": 2.0}), "rope_scaling=.*linear", id="rope-scaling"),
        pytest.param(set_key("rope_theta", 5.0), r"rope_theta=5.0 disagrees with rope_parameters.rope_theta=1000.0", id="rope-conflict"),
        pytest.param(set_key("hidden_act", "gelu"), "hidden_act='gelu'", id="activation"),
        pytest.param(set_key("attention_bias", True), "attention_bias=True", id="bias"),
        pytest.param(set_key("sliding_window", 16), "sliding_window=16 with model_type 'llama'", id="llama-window"),
        pytest.param(set_key("hidden_size", None), "required key 'hidden_size' is missing", id="missing-key"),
        pytest.param(set_key("num_key_value_heads", 3), "json: num_attention_heads=4 is not a multiple of num_key_value_heads=3", id="bad-value"),
        pytest.param(set_key("num_key_value_heads", 0), "json: num_key_value_heads must be an int >= 1, got 0", id="kv-heads-zero"),
        pytest.param(set_key("head_dim", 0), "json: head_dim must be an int >= 1, got 0", id="head-dim-zero"),
        pytest.param(set_rope_theta(float("inf")), "rope_theta=inf must be a positive finite number", id="theta-inf"),
        pytest.param(set_key("rms_norm_eps", float("nan")), "rms_norm_eps=nan must be a positive finite", id="eps-nan"),
        pytest.param(set_key("num_hidden_layers", 10**12), "num_hidden_layers=1000000000000 exceeds the limit of 1024", id="layers-limit"),
        pytest.param(set_key("max_position_embeddings", 1e12), r"max_position_embeddings=1000000000000.0 exceeds the limit of 2147483647", id="positions-limit"),
        pytest.param(set_key("layer_types", "attention"), "layer_types is only read for 'ministral' and 'kvcache_hybrid'", id="layer-types-llama"),
    ],
)  # fmt: skip
def test_load_config_rejects(
    llama_dir: Path, edit: Callable[[dict[str, Any]], None], match: str
) -> None:
    edit_json(llama_dir / "config.json", edit)
    with pytest.raises(CheckpointError, match=match) as info:
        load_config(llama_dir)
    assert str(llama_dir / "config.json") in str(info.value)


@pytest.mark.parametrize("value", [pytest.param(None, id="null"), pytest.param("absent", id="absent")])
def test_kv_heads_unset_means_one_per_query_head(llama_dir: Path, value: str | None) -> None:
    def edit(raw: dict[str, Any]) -> None:
        if value == "absent":
            del raw["num_key_value_heads"]
        else:
            raw["num_key_value_heads"] = value

    edit_json(llama_dir / "config.json", edit)
    assert load_config(llama_dir).num_kv_heads == HF_SHAPE["num_attention_heads"]


def test_config_that_is_not_utf8_names_the_file(llama_dir: Path) -> None:
    config = llama_dir / "config.json"
    config.write_bytes(config.read_bytes().replace(b'"llama"', b'"ll\xe4ma"'))
    with pytest.raises(CheckpointError, match=rf"{config}: not UTF-8 text: .*byte 0xe4"):
        load_config(llama_dir)


def test_missing_config_json(llama_dir: Path) -> None:
    (llama_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_pretrained(llama_dir)


def test_pickle_only_directory_is_refused(llama_dir: Path) -> None:
    (llama_dir / WEIGHTS).unlink()
    # Not a valid pickle: if the loader tried to unpickle it, the error would differ.
    (llama_dir / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(CheckpointError, match=r"\['pytorch_model.bin'\]; refusing to unpickle"):
        load_pretrained(llama_dir)
    (llama_dir / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_pretrained(llama_dir)


def test_index_naming_files_outside_the_folder_is_refused(tmp_path: Path) -> None:
    model = Transformer(get_preset("tiny"), seed=0)
    save_pretrained(model, tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"names files outside the checkpoint folder: "
                                              r"\['\.\./elsewhere\.safetensors'\]"):
        load_pretrained(tmp_path)

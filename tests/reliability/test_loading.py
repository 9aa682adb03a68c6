"""Loading never runs code from files: YAML only through safe loading, weights only
through safetensors, nothing evaluated; and hostile sizes or values in a checkpoint are
refused before anything is sized from them.

The hostile files here would create a marker file if anything constructed, unpickled or
evaluated them; every test asserts the marker does not exist afterwards.
"""

from __future__ import annotations

import ast
import json
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from harness.cli import main as kvharness
from harness.lists.db import load_test_db
from harness.lists.errors import ListError
from kvcache import Engine, KvCacheConfig
from kvcache.model import ModelConfig, Transformer
from kvcache.model.checkpoint import CheckpointError, load_pretrained, save_pretrained
from tests.reliability.support import assert_same_outputs

ROOT = Path(__file__).resolve().parents[2]
CACHE = KvCacheConfig(tokens_per_block=4, max_num_blocks=16)
SMALL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=16)


class MarkerPickle:
    """Unpickling this creates `path` (open(path, "w")): proof that pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    """Where a hostile file would leave its mark; must not exist after the test."""
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a hostile file was executed: the marker exists"


# -- YAML --------------------------------------------------------------------------------

HEAD = "version: 0.0.1\nl0_cpu:\n- condition:\n    terms:\n      stage: pre_merge\n  tests:\n"


@pytest.mark.parametrize(("body", "line"), [
    pytest.param("  - !!python/object/apply:builtins.open ['{m}', 'w']\n", 7, id="apply-open"),
    pytest.param("  - !!python/object/apply:os.mkdir ['{m}']\n", 7, id="apply-mkdir"),
    pytest.param("  - !!python/object/new:pathlib.Path ['{m}']\n", 7, id="new-path"),
    pytest.param("  - !!python/name:os.system\n", 7, id="name"),
    pytest.param("  - x\nextra: !!python/object/apply:builtins.open ['{m}', 'w']\n", 8,
                 id="top-level"),
])
def test_yaml_python_tags_are_rejected_unconstructed(tmp_path: Path, marker: Path, body: str,
                                                     line: int) -> None:
    lists = tmp_path / "test-db"
    lists.mkdir()
    (lists / "l0_cpu.yml").write_text(HEAD + body.format(m=marker))
    with pytest.raises(ListError, match=r"could not determine a constructor for the tag "
                                        r"'tag:yaml\.org,2002:python/") as info:
        load_test_db(lists)
    assert f"{lists / 'l0_cpu.yml'}:{line}:" in str(info.value)


def test_the_hostile_payloads_are_live(tmp_path: Path) -> None:
    """Canary: unsafe loaders do run these payloads, so their absence above means something."""
    made = tmp_path / "MADE"
    yaml.unsafe_load(f"- !!python/object/apply:builtins.open ['{made}', 'w']")
    assert made.exists()
    made.unlink()
    pickle.loads(pickle.dumps(MarkerPickle(made)))  # unsafe on purpose: proves the payload
    assert made.exists()


def test_kvharness_refuses_a_tagged_list(tmp_path: Path, marker: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "l0_cpu.yml").write_text(
        HEAD + f"  - !!python/object/apply:builtins.open ['{marker}', 'w']\n")
    assert kvharness(["list", "--test-db", str(tmp_path)]) == 1
    assert "python/object/apply:builtins.open" in capsys.readouterr().err


# -- checkpoints -------------------------------------------------------------------------

@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, Transformer]:
    model = Transformer(SMALL, seed=3)
    path = tmp_path / "ckpt"
    save_pretrained(model, path)
    return path, model


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pickle_only_checkpoint_is_refused_unopened(checkpoint: tuple[Path, Transformer],
                                                    marker: Path, name: str) -> None:
    path, _ = checkpoint
    (path / "model.safetensors").unlink()
    (path / name).write_bytes(pickle.dumps(MarkerPickle(marker)))
    with pytest.raises(CheckpointError, match=rf"{path}: only pickle-based weights "
                                              rf"\['{name}'\]; refusing to unpickle"):
        Engine.from_pretrained(path, CACHE)


def test_pickle_beside_safetensors_is_ignored(checkpoint: tuple[Path, Transformer],
                                              marker: Path) -> None:
    path, model = checkpoint
    (path / "pytorch_model.bin").write_bytes(pickle.dumps(MarkerPickle(marker)))
    loaded = Engine.from_pretrained(path, CACHE)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    assert_same_outputs(Engine(model, CACHE).generate(prompts, 2),
                        loaded.generate(prompts, 2), "loaded beside a pickle")


def test_index_naming_a_pickle_is_never_unpickled(checkpoint: tuple[Path, Transformer],
                                                  marker: Path) -> None:
    path, _ = checkpoint
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(pickle.dumps(MarkerPickle(marker)))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "pytorch_model.bin"}}))
    with pytest.raises(CheckpointError, match=rf"{path / 'pytorch_model.bin'}: not a readable "
                                              r"safetensors file"):
        load_pretrained(path)


@pytest.mark.parametrize(("key", "value"), [
    pytest.param("model_type", "__import__('os').mkdir('{m}')", id="model-type"),
    pytest.param("hidden_act", "lambda x: open('{m}', 'w')", id="hidden-act"),
    pytest.param("rope_theta", "__import__('os').mkdir('{m}') or 10000.0", id="rope-theta"),
])
def test_config_strings_are_data_not_code(checkpoint: tuple[Path, Transformer], marker: Path,
                                          key: str, value: str) -> None:
    path, _ = checkpoint
    raw = json.loads((path / "config.json").read_text())
    raw[key] = value.format(m=marker)
    raw.pop("rope_parameters")
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=rf"{path / 'config.json'}: .*{key}"):
        load_pretrained(path)


def test_torch_save_file_named_safetensors_is_not_unpickled(
        checkpoint: tuple[Path, Transformer], marker: Path) -> None:
    path, _ = checkpoint
    torch.save({"x": MarkerPickle(marker)}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{path / 'model.safetensors'}: not a readable "
                                              r"safetensors file"):
        load_pretrained(path)


# -- hostile sizes and values ------------------------------------------------------------

def edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | changes))


def test_longest_context_sizes_nothing_by_it(checkpoint: tuple[Path, Transformer]) -> None:
    """max_position_embeddings has no weights to check it against: the engine sizes its
    block table by the pool, which bounds every request, never by the model's length."""
    path, model = checkpoint
    edit_config(path, max_position_embeddings=2**31 - 1)  # the largest int32 lengths allow
    engine = Engine.from_pretrained(path, CACHE, max_batch_size=3)
    assert engine.max_model_len == 2**31 - 1
    assert engine.table.blocks.shape == (3, CACHE.max_num_blocks)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    assert_same_outputs(Engine(model, CACHE).generate(prompts, 2),
                        engine.generate(prompts, 2), "with the longest context")


def test_layer_count_is_checked_against_the_weights_first(
        checkpoint: tuple[Path, Transformer]) -> None:
    """Within the limit but beyond the weights: one line naming the key and what the
    weights hold, not a line per missing tensor of every absent layer."""
    path, _ = checkpoint
    edit_config(path, num_hidden_layers=1024)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(path)
    assert str(info.value) == (f"{path / 'config.json'}: num_hidden_layers=1024, but the "
                               f"weights in {[str(path / 'model.safetensors')]} hold only "
                               "layer 0")


def test_config_json_path_loads_its_folder(checkpoint: tuple[Path, Transformer]) -> None:
    path, model = checkpoint
    engine = Engine.from_pretrained(path / "config.json", CACHE)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    assert_same_outputs(Engine(model, CACHE).generate(prompts, 2),
                        engine.generate(prompts, 2), "loaded through config.json")


def set_weight(path: Path, name: str, index: tuple[int, ...], value: float) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors[name][index] = value
    save_file(tensors, path / "model.safetensors")


def test_non_finite_weights_are_refused_unless_unchecked(
        checkpoint: tuple[Path, Transformer]) -> None:
    path, _ = checkpoint
    set_weight(path, "model.norm.weight", (5,), float("nan"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' in .*: 1 NaN and 0 "
                                              r"infinite values \(read as torch\.float32\)"):
        Engine.from_pretrained(path, CACHE)
    engine = Engine.from_pretrained(path, CACHE, check_finite=False)  # trusted: not scanned
    norm = engine.model.norm.weight
    assert norm[5].isnan() and norm.isnan().sum() == 1, "the weights are loaded as stored"


def test_a_cast_that_overflows_counts_as_non_finite(checkpoint: tuple[Path, Transformer]) -> None:
    """70000 is a float32 value but beyond float16's range: loaded as float16 it is inf."""
    path, _ = checkpoint
    set_weight(path, "lm_head.weight", (0, 0), 70000.0)
    assert load_pretrained(path).output.weight[0, 0] == 70000.0
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head\.weight' in .*: 0 NaN and 1 "
                                              r"infinite values \(read as torch\.float16\)"):
        load_pretrained(path, dtype=torch.float16)


# -- the sources -------------------------------------------------------------------------

# Calls that deserialize or evaluate arbitrary code; none may appear in kvcache/ or harness/.
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_ATTRS = {("pickle", "load"), ("pickle", "loads"), ("torch", "load"),
                   ("yaml", "load"), ("yaml", "load_all"), ("yaml", "unsafe_load"),
                   ("yaml", "full_load"), ("yaml", "Loader"), ("yaml", "UnsafeLoader"),
                   ("yaml", "FullLoader"), ("marshal", "loads"), ("dill", "loads"),
                   ("shelve", "open"), ("numpy", "load"), ("np", "load")}
FORBIDDEN_MODULES = {"pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def unsafe_uses(source: str, name: str) -> list[str]:
    """Each forbidden call, attribute or import in `source`, as 'name:line: what'."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in FORBIDDEN_CALLS:
            found.append(f"{where}: {node.func.id}()")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and (node.value.id, node.attr) in FORBIDDEN_ATTRS:
            found.append(f"{where}: {node.value.id}.{node.attr}")
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                else [node.module or ""]
            found += [f"{where}: import {n}" for n in names
                      if n.split(".")[0] in FORBIDDEN_MODULES]
    return found


def test_no_unsafe_loader_or_eval_in_the_sources() -> None:
    files = sorted((ROOT / "kvcache").rglob("*.py")) + sorted((ROOT / "harness").rglob("*.py"))
    assert len(files) > 20
    found = [use for f in files for use in unsafe_uses(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == [], "unsafe deserialization or evaluation:\n  " + "\n  ".join(found)


def test_the_source_scan_sees_what_it_forbids() -> None:
    sample = ("import pickle\nimport yaml\nimport torch\nyaml.load(s, Loader=yaml.Loader)\n"
              "torch.load(f)\neval('1')\nmodel.eval()\nyaml.SafeLoader\n")
    found = sorted(unsafe_uses(sample, "sample.py"))
    assert found == ["sample.py:1: import pickle", "sample.py:4: yaml.Loader",
                     "sample.py:4: yaml.load", "sample.py:5: torch.load", "sample.py:6: eval()"]

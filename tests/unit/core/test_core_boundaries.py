"""The core's boundaries: what importing it loads, and what its handles let callers do."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvcache import KvCacheConfig, ReuseScope
from kvcache.core.validate import check_int, check_positive_int, check_priority

HEAVY = ("torch", "numpy", "flashinfer", "torch._dynamo")


def _loaded_after(statement: str) -> set[str]:
    """Heavy modules (HEAVY) in sys.modules after `statement` in a fresh interpreter."""
    code = f"{statement}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize(("statement", "allowed"), [
    pytest.param("import kvcache", set(), id="kvcache"),
    pytest.param("import kvcache.core", set(), id="core"),
    pytest.param("from kvcache import KvCacheManager, KvCacheConfig, ReuseScope", set(),
                 id="public-names"),
    pytest.param("import kvcache.attention.block_table", {"numpy"}, id="block-table"),
    pytest.param("import kvcache.engine.scheduler", {"numpy"}, id="scheduler"),
    pytest.param("import kvcache.attention, kvcache.engine, kvcache.model", set(),
                 id="lazy-packages"),
])
def test_imports_load_only_what_they_need(statement: str, allowed: set[str]) -> None:
    assert _loaded_after(statement) == allowed


def test_the_engine_loads_torch_but_not_flashinfer() -> None:
    assert _loaded_after("from kvcache import Engine") == {"torch", "numpy"}


def test_loading_a_checkpoint_does_not_import_the_compiler(tmp_path) -> None:
    """The loader builds its model on the meta device without initialising it: an
    initialiser run there imports torch._dynamo, a second of every engine's start."""
    statement = (
        "from kvcache.model import ModelConfig, Transformer\n"
        "from kvcache.model.checkpoint import load_pretrained, save_pretrained\n"
        "config = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16,"
        " num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)\n"
        f"save_pretrained(Transformer(config, seed=1), {str(tmp_path)!r})\n"
        f"assert load_pretrained({str(tmp_path)!r}).config == config"
    )
    assert _loaded_after(statement) == {"torch", "numpy"}


def test_a_sequence_handle_is_read_only(make_manager) -> None:
    mgr = make_manager(4, 8)
    seq = mgr.add_sequence("a", [1, 2, 3, 4, 5])
    for field in ("seq_id", "num_cached_tokens", "block_ids", "num_tokens", "tokens",
                  "num_committed_tokens", "scope", "priority"):
        with pytest.raises(AttributeError):
            setattr(seq, field, 0)
    with pytest.raises(AttributeError):
        seq.tree_blocks = 3  # type: ignore[attr-defined]
    assert (seq.seq_id, seq.num_tokens, len(seq.block_ids)) == ("a", 5, 2)
    mgr.free_sequence("a")


def test_the_live_sequences_are_a_read_only_view(make_manager) -> None:
    mgr = make_manager(4, 8)
    seq = mgr.add_sequence("a", [1, 2, 3, 4, 5])
    assert list(mgr.sequences) == ["a"] and mgr.sequences["a"].block_ids is seq.block_ids
    assert mgr.sequences["a"].seq_id == "a" and "a" in mgr.sequences
    for change in (lambda: mgr.sequences.pop("a"), lambda: mgr.sequences.clear(),
                   lambda: mgr.sequences.__setitem__("b", seq)):
        with pytest.raises(AttributeError):
            change()
    mgr.free_sequence("a")
    assert not mgr.sequences and mgr.sequences.get("a") is None
    assert seq.num_tokens == 5  # a freed sequence's handle stays readable


def test_a_plan_is_an_immutable_record(make_manager) -> None:
    mgr = make_manager(4, 8)
    plan = mgr.plan_admission([1, 2, 3, 4, 5])
    for field in ("num_new_blocks", "num_available", "injected_fault", "hits", "cache"):
        with pytest.raises(AttributeError):
            setattr(plan, field, 0)
    assert (plan.num_new_blocks, plan.num_blocks, plan.fits) == (2, 2, True)


def test_the_old_names_are_the_new_ones() -> None:
    import kvcache

    assert kvcache.KvCacheManager is kvcache.KvCacheManager
    assert not hasattr(kvcache, "Sequence")  # the handle no longer shadows abc.Sequence


@pytest.mark.parametrize(("value", "ok"), [
    (3, 3), (np.int64(3), 3), (np.uint8(7), 7), (True, None), (3.0, None), ("3", None),
    (0, None), (None, None),
])
def test_one_rule_for_integers(value: object, ok: int | None) -> None:
    if ok is None:
        with pytest.raises(ValueError, match=r"where must be an int >= 1, got "):
            check_positive_int(value, "where")
    else:
        result = check_positive_int(value, "where")
        assert result == ok and type(result) is int


def test_priorities_and_bounds() -> None:
    assert check_priority(35, "x") == 35 and check_priority(np.int32(100), "x") == 100
    for bad in (101, -1, True, 3.5):
        with pytest.raises(ValueError, match=r"x: priority must be an int in \[0, 100\]"):
            check_priority(bad, "x")
    assert check_int(-5, "n") == -5
    with pytest.raises(ValueError, match=r"n must be an int <= 2, got 3"):
        check_int(3, "n", maximum=2)


def test_numpy_sizes_become_ints() -> None:
    cfg = KvCacheConfig(tokens_per_block=np.int64(8), max_num_blocks=np.int32(4))
    assert type(cfg.tokens_per_block) is int and type(cfg.max_num_blocks) is int


@pytest.mark.parametrize(("kwargs", "message"), [
    pytest.param({"salt": True}, r"ReuseScope\.salt .* got True", id="bool-salt"),
    pytest.param({"salt": 1.0}, r"ReuseScope\.salt .* got 1\.0", id="float-salt"),
    pytest.param({"salt": ["x"]}, r"ReuseScope\.salt .* got \['x'\]", id="unhashable-salt"),
    pytest.param({"lora_id": -1}, r"ReuseScope\.lora_id must be an int >= 0", id="neg-lora"),
    pytest.param({"lora_id": "a"}, r"ReuseScope\.lora_id must be an int >= 0", id="str-lora"),
])
def test_scopes_that_would_alias_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReuseScope(**kwargs)  # type: ignore[arg-type]


def test_equal_scopes_share_and_numpy_salts_normalise(make_manager) -> None:
    assert ReuseScope(salt=np.int64(1)).key == ReuseScope(salt=1).key
    assert ReuseScope(salt=0).key != ReuseScope().key
    mgr = make_manager(4, 8)
    mgr.add_sequence("a", [1, 2, 3, 4, 5], scope=ReuseScope(salt=1))
    mgr.commit("a", 5)
    mgr.free_sequence("a")
    assert mgr.probe_reuse([1, 2, 3, 4, 5], ReuseScope(salt=np.int8(1))) == 4
    assert mgr.probe_reuse([1, 2, 3, 4, 5], ReuseScope(salt="1")) == 0


@pytest.mark.parametrize("tokens", [[True], [5, False], [300, 1, True, 7]])
def test_bool_tokens_are_refused(make_manager, tokens: list[int]) -> None:
    mgr = make_manager(4, 8)
    with pytest.raises(ValueError, match=r"add_sequence\('a'\): token \d is (True|False); "
                                         "tokens must be integers, not bools"):
        mgr.add_sequence("a", tokens)
    assert not mgr.sequences
    mgr.add_sequence("b", [0, 1, 256, 65536])  # small and zero-byte ints are fine
    mgr.free_sequence("b")

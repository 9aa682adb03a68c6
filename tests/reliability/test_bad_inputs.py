"""A catalogue of bad inputs, each rejected with a message naming the value and its source.

Every case states the exception and the message it must carry. Engine and manager cases
also check that the failed call changed nothing and the object stays usable. The
catalogue is documented in docs/bad_inputs.md; a test keeps the two in step.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.cli import main as kvharness
from harness.lists.db import load_test_db
from harness.lists.errors import ListError
from harness.lists.kill_record import load_kills
from harness.lists.waives import default_waives, load_waives
from kvcache import Engine, EngineConfig, KvCacheConfig, KvCacheManager
from kvcache.core.ops import BlockCopy, BlockOffload, BlockOnboard, KvOp
from kvcache.engine import RequestFinishedError
from kvcache.model import Transformer, get_preset
from kvcache.model.checkpoint import CheckpointError, load_pretrained, save_pretrained
from kvcache.storage.kv_storage import KvStorage
from tests.harness.conform.test_replay import REPLAY_IDS
from tests.harness.conform.test_worker import WORKER_IDS
from tests.harness.plugin.test_sharding import SHARD_IDS
from tests.reliability.support import EngineSpec, assert_clean
from tests.reliability.test_hostile_repro import REPRO_IDS
from tests.tools.test_generic_mutants import GENERIC_IDS
from tests.tools.test_mutants import MUTANT_IDS

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md"
IDS: set[str] = set()  # every case id below, checked against the document


def cases(*params: Any) -> list[Any]:
    IDS.update(p.id for p in params)
    return list(params)


# -- KvCacheConfig ------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), cases(
    pytest.param({"tokens_per_block": 0}, r"KvCacheConfig\.tokens_per_block must be an int >= 1, got 0",
                 id="cfg-block-zero"),
    pytest.param({"tokens_per_block": "16"}, r"KvCacheConfig\.tokens_per_block must be an int >= 1, "
                 r"got '16'", id="cfg-block-str"),
    pytest.param({"max_num_blocks": -3}, r"KvCacheConfig\.max_num_blocks must be an int in "
                 r"\[1, 2147483647\], got -3", id="cfg-pool-negative"),
    pytest.param({"max_num_blocks": True}, r"KvCacheConfig\.max_num_blocks must be an int in "
                 r"\[1, 2147483647\], got True", id="cfg-pool-bool"),
    pytest.param({"max_num_blocks": 10**30}, r"KvCacheConfig\.max_num_blocks must be an int in "
                 r"\[1, 2147483647\], got 1000000000000000000000000000000", id="cfg-pool-huge"),
    pytest.param({"enable_block_reuse": "yes"}, r"KvCacheConfig\.enable_block_reuse must be "
                 r"True, False or None, got 'yes'", id="cfg-flag-str"),
    pytest.param({"enable_block_reuse": False, "enable_partial_reuse": True},
                 r"enable_partial_reuse=True needs block reuse, but enable_block_reuse=False",
                 id="cfg-partial-without-reuse"),
    pytest.param({"enable_partial_reuse": False, "copy_on_partial_reuse": True},
                 r"copy_on_partial_reuse=True needs partial reuse, but "
                 r"enable_partial_reuse=False", id="cfg-copy-without-partial"),
    pytest.param({"reuse_alignment_blocks": 2, "enable_partial_reuse": True},
                 r"enable_partial_reuse=True cannot start reuse inside a block, but "
                 r"reuse_alignment_blocks=2", id="cfg-align-partial"),
    pytest.param({"sliding_window": 0}, r"KvCacheConfig\.sliding_window must be an int >= 1, "
                 r"got 0", id="cfg-window-zero"),
    pytest.param({"host_cache_blocks": -8}, r"KvCacheConfig\.host_cache_blocks must be an int "
                 r"in \[0, 2147483647\], got -8", id="cfg-host-negative"),
    pytest.param({"host_cache_blocks": 10**30}, r"KvCacheConfig\.host_cache_blocks must be an "
                 r"int in \[0, 2147483647\], got 1000000000000000000000000000000",
                 id="cfg-host-huge"),
    pytest.param({"enable_block_reuse": False, "host_cache_blocks": 64},
                 r"KvCacheConfig\.host_cache_blocks=64 keeps evicted cached blocks for reuse, "
                 r"but enable_block_reuse=False caches nothing; set host_cache_blocks=0",
                 id="cfg-host-without-reuse"),
    pytest.param({"sliding_window": 32, "host_cache_blocks": 64},
                 r"KvCacheConfig\.host_cache_blocks=64 is unsupported with sliding_window=32",
                 id="cfg-host-window"),
))
def test_bad_cache_config(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KvCacheConfig(**kwargs)


def test_cache_config_from_dict_names_unknown_keys_and_source() -> None:
    with pytest.raises(ValueError, match=r"engine\.yaml: unknown KvCacheConfig keys "
                                         r"\['block_size'\]; known keys are"):
        KvCacheConfig.from_dict({"block_size": 16}, where="engine.yaml")


IDS.add("cfg-unknown-key")


# -- KvCacheManager ------------------------------------------------------------------------

ManagerCall = Callable[[KvCacheManager], object]


@pytest.mark.parametrize(("call", "message"), cases(
    pytest.param(lambda m: m.add_sequence("x", [1, -1]), r"add_sequence\('x'\): token 1 is -1; "
                 r"tokens must be integers in \[0, 2\*\*32\)", id="mgr-token-negative"),
    pytest.param(lambda m: m.add_sequence("x", [1, 2.5]), r"add_sequence\('x'\): token 1 is 2\.5",
                 id="mgr-token-float"),
    pytest.param(lambda m: m.add_sequence("x", []), r"add_sequence\('x'\): empty prompt",
                 id="mgr-empty"),
    pytest.param(lambda m: m.add_sequence("live", [1, 2]), r"add_sequence\('live'\): seq_id is "
                 r"already live", id="mgr-duplicate-id"),
    pytest.param(lambda m: m.add_sequence("x", [1], priority=101), r"add_sequence\('x'\): "
                 r"priority must be an int in \[0, 100\], got 101", id="mgr-priority"),
    pytest.param(lambda m: m.add_sequence("x", [1], scope="tenant"),
                 r"add_sequence\('x'\): expected None or ReuseScope, got 'tenant'",
                 id="mgr-scope-str"),
    pytest.param(lambda m: m.commit("live", 99), r"commit\('live', 99\): beyond the sequence's "
                 r"6 tokens", id="mgr-commit-beyond"),
    pytest.param(lambda m: m.commit("live", 1), r"commit\('live', 1\): goes backwards; 4 tokens "
                 r"are already committed", id="mgr-commit-backwards"),
    pytest.param(lambda m: m.append_tokens("gone", [1]), r"append_tokens: unknown seq_id 'gone'",
                 id="mgr-unknown-seq"),
    pytest.param(lambda m: m.reserve("live", 7), r"reserve\('live'\): num_tokens must be an "
                 r"int in \[0, 6\], got 7", id="mgr-reserve-beyond"),
    pytest.param(lambda m: m.ack_copy_ops(1), r"ack_copy_ops: num_applied must be an int in "
                 r"\[0, 0\], got 1", id="mgr-ack-beyond"),
    pytest.param(lambda m: m.plan_admission([1, 2], first_chunk=0), r"plan_admission: "
                 r"first_chunk must be an int >= 1, got 0", id="mgr-first-chunk"),
    pytest.param(lambda m: m.match_reuse([1, 2], first_chunk=True), r"match_reuse: "
                 r"first_chunk must be an int >= 1, got True", id="mgr-match-first-chunk"),
    pytest.param(lambda m: m.probe_reuse([3, None]),
                 r"probe_reuse: token 1 is None", id="mgr-probe-token"),
    pytest.param(lambda m: KvCacheManager({"tokens_per_block": 4}),  # type: ignore[arg-type]
                 r"KvCacheManager: expected a KvCacheConfig, got \{'tokens_per_block': 4\}",
                 id="mgr-config-dict"),
))
def test_bad_manager_call_changes_nothing(call: ManagerCall, message: str) -> None:
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8))
    mgr.add_sequence("live", [1, 2, 3, 4, 5, 6])
    mgr.commit("live", 4)
    before = (mgr.state.tree.dump(), mgr.stats(), list(mgr.sequences["live"].block_ids))
    with pytest.raises(ValueError, match=message):
        call(mgr)
    assert (mgr.state.tree.dump(), mgr.stats(), list(mgr.sequences["live"].block_ids)) == before
    mgr.check_integrity()
    mgr.free_sequence("live")
    assert mgr.probe_reuse([1, 2, 3, 4, 5]) == 4, "what was committed stays reusable"
    assert_clean(mgr, "after the bad call")


# -- KvStorage.apply_copies ---------------------------------------------------------------

@pytest.mark.parametrize(("op", "message"), cases(
    pytest.param(BlockOffload(True, 0), r"apply_copies: ops\[1\]\.src=True is a bool, not an "
                 r"int", id="storage-op-bool"),
    pytest.param(BlockOnboard(0, 1, 2.0), r"apply_copies: ops\[1\]\.num_tokens=2\.0 is a "
                 r"float, not an int", id="storage-op-tokens-float"),
))
def test_a_bad_op_is_refused_before_any_is_applied(op: KvOp, message: str) -> None:
    storage = KvStorage(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2,
                        host_num_blocks=2)
    assert storage.host is not None
    for t in (*storage.tensors, *storage.host.tensors):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape))
    before = [t.clone() for t in (*storage.tensors, *storage.host.tensors)]
    with pytest.raises(ValueError, match=message):
        storage.apply_copies([BlockCopy(1, 2, 4), op])  # the copy before it is not applied
    after = (*storage.tensors, *storage.host.tensors)
    assert all(map(torch.equal, after, before)), "a refused batch changed the storage"
    assert storage.num_applied == 0
    storage.apply_copies([BlockCopy(1, 2, 4)])
    assert storage.num_applied == 1 and torch.equal(storage.k[0][2], storage.k[0][1])


@pytest.mark.parametrize("field", cases(
    pytest.param("max_num_blocks", id="mgr-pool-memory"),
    pytest.param("host_cache_blocks", id="mgr-host-memory"),
))
def test_a_pool_that_does_not_fit_in_memory_names_its_field(field: str) -> None:
    """A pool within KvCacheConfig's bound whose free list (one int a block) cannot be
    built: in a child process whose address space is capped at 1 GiB, the 2**31 - 1
    blocks' list (16 GiB of pointers) fails at once, and the manager names the field."""
    pytest.importorskip("resource", reason="RLIMIT_AS needs a POSIX system")
    sizes = {"max_num_blocks": 8, field: 2**31 - 1}
    code = ("import resource\n"
            "resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))\n"
            "from kvcache import KvCacheConfig, KvCacheManager\n"
            f"KvCacheManager(KvCacheConfig(**{sizes!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], check=False)
    assert done.returncode == 1, done.stderr
    assert (f"ValueError: KvCacheManager: out of memory building the free list of "
            f"KvCacheConfig.{field}=2147483647 blocks; lower it") in done.stderr


def _manager_state(mgr: KvCacheManager) -> tuple[object, ...]:
    return (mgr.state.tree.dump(), mgr.stats(), list(mgr.state.op_queue), list(mgr.state.pool.free),
            {sid: (s.num_committed_tokens, list(s.block_ids), s.block_ids_version)
             for sid, s in mgr.sequences.items()})


def test_a_commit_while_its_copy_is_queued_changes_nothing() -> None:
    """B reuses 3 tokens of [1, 2, 2, 2] by a queued BlockCopy nobody took: a commit of
    computed tokens is refused naming the copy (no forward pass read it), changing
    nothing; once the copy is taken the commit goes through."""
    mgr = KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8))
    mgr.add_sequence("A", [1, 2, 2, 2, 0])
    mgr.commit("A", 5)
    mgr.free_sequence("A")
    mgr.add_sequence("B", [1, 2, 2, 0, 1])
    before = _manager_state(mgr)
    with pytest.raises(ValueError, match=r"commit\('B', 5\): its BlockCopy\(src=1, dst=3, "
                                         r"num_tokens=3\) is still queued"):
        mgr.commit("B", 5)
    assert _manager_state(mgr) == before
    mgr.take_copy_ops()
    mgr.commit("B", 5)
    mgr.free_sequence("B")
    assert mgr.probe_reuse([1, 2, 2, 0, 1, 9]) == 5
    assert_clean(mgr, "after the refused commit")


IDS.add("mgr-commit-copy-queued")


def test_a_plan_from_another_manager_changes_nothing() -> None:
    """A plan is bound to the manager that made it, even when the other's version number
    matches (both made the same number of changes)."""
    a, b = (KvCacheManager(KvCacheConfig(tokens_per_block=4, max_num_blocks=8))
            for _ in range(2))
    for mgr, tokens in ((a, [1, 2, 3, 4, 5]), (b, [6, 7, 8, 9, 10])):
        mgr.add_sequence("x", tokens)
        mgr.commit("x", 5)
        mgr.free_sequence("x")
    plan = a.plan_admission([1, 2, 3, 4, 5, 6])
    before = _manager_state(b)
    with pytest.raises(ValueError, match=r"admit\('y'\): AdmissionPlan\(tokens=6, cached=5, "
                                         r".*\) was made by another KvCacheManager, not this "
                                         r"one"):
        b.admit("y", plan)
    assert _manager_state(b) == before
    b.check_integrity()
    a.admit("y", plan)
    a.free_sequence("y")
    for mgr in (a, b):
        assert_clean(mgr, "after the refused admission")


IDS.add("mgr-plan-foreign")


# -- Engine.add_request / generate ---------------------------------------------------------

EngineCall = Callable[[Engine], object]
MAX = get_preset("tiny").max_position_embeddings


@pytest.mark.parametrize(("call", "message"), cases(
    pytest.param(lambda e: e.add_request([1, 512], 1), r"add_request\(#0\): prompt: token 1 is "
                 r"512; tokens must be ints in \[0, 512\) \(the model's vocab_size\)",
                 id="req-token-vocab"),
    pytest.param(lambda e: e.add_request([-4], 1), r"add_request\(#0\): prompt: token 0 is -4",
                 id="req-token-negative"),
    pytest.param(lambda e: e.add_request([1, 2.0], 1), r"prompt: token 1 is 2\.0",
                 id="req-token-float"),
    pytest.param(lambda e: e.add_request([True], 1), r"prompt: token 0 is True",
                 id="req-token-bool"),
    pytest.param(lambda e: e.add_request(["7"], 1), r"prompt: token 0 is '7'",
                 id="req-token-str"),
    pytest.param(lambda e: e.add_request([], 1), r"add_request\(#0\): empty prompt",
                 id="req-empty"),
    pytest.param(lambda e: e.add_request([1] * MAX, 1), rf"add_request\(#0\): prompt of {MAX} "
                 rf"tokens \+ 1 new exceeds the model's maximum of {MAX}", id="req-too-long"),
    pytest.param(lambda e: e.add_request([1], 0), r"max_new_tokens must be an int >= 1, got 0",
                 id="req-no-new-tokens"),
    pytest.param(lambda e: e.add_request([1], 2.5), r"max_new_tokens must be an int >= 1, "
                 r"got 2\.5", id="req-new-tokens-float"),
    pytest.param(lambda e: e.add_request([1] * 60, 10), r"add_request\(#0\): needs 18 blocks, "
                 r"the pool has only 16: it can never fit", id="req-pool"),
    pytest.param(lambda e: e.add_request([1], 1, scope=3),
                 r"scope must be None or ReuseScope, got 3", id="req-scope"),
    pytest.param(lambda e: e.add_request([1], 1, priority=-1), r"priority must be an int in "
                 r"\[0, 100\], got -1", id="req-priority"),
    pytest.param(lambda e: e.add_request([1], 3, force_tokens=[5]), r"force_tokens has 1 "
                 r"tokens, max_new_tokens is 3", id="req-forced-short"),
    pytest.param(lambda e: e.add_request([1], 1, force_tokens=[900]), r"add_request\(#0\): "
                 r"force_tokens: token 0 is 900", id="req-forced-vocab"),
    pytest.param(lambda e: e.generate([[1], [2]], 1, scopes=[None]), r"generate: 1 scopes for "
                 r"2 prompts", id="gen-scopes-length"),
    pytest.param(lambda e: e.generate([[1, 2], [1, -2]], 1), r"add_request\(#1\): prompt: "
                 r"token 1 is -2", id="gen-second-prompt"),
    pytest.param(lambda e: e.generate([5], 1), r"generate: prompts must be a list of token "
                 r"lists; prompt 0 is 5 \(for one prompt, pass \[\[\.\.\.\]\]\)",
                 id="gen-bare-prompt"),
    pytest.param(lambda e: e.add_request(5, 1), r"add_request\(#0\): prompt: expected a "
                 r"sequence of token ids, got 5", id="req-prompt-int"),
    pytest.param(lambda e: e.add_request([np.True_], 1), r"add_request\(#0\): prompt: token 0 "
                 r"is (np\.)?True_?; tokens must be ints", id="req-token-numpy-bool"),
    pytest.param(lambda e: e.abort(7), r"abort\(7\): no such request; no request was added yet",
                 id="abort-unknown"),
))
def test_bad_request_changes_nothing(tiny_model: Transformer, call: EngineCall,
                                     message: str) -> None:
    engine = EngineSpec(4, 16).build(tiny_model)
    before = (engine.manager.state.tree.dump(), engine.kv_cache_stats())
    with pytest.raises(ValueError, match=message):
        call(engine)
    assert not engine.has_unfinished(), "the rejected call left requests queued"
    assert (engine.manager.state.tree.dump(), engine.kv_cache_stats()) == before
    out = engine.generate([[1, 2, 3]], max_new_tokens=2)
    assert out[0].request_id == 0 and len(out[0].token_ids) == 2, "the engine stays usable"
    assert_clean(engine.manager, "after the bad request")


def test_numpy_int_tokens_are_accepted(tiny_model: Transformer) -> None:
    engine = EngineSpec(4, 16).build(tiny_model)
    ints = engine.generate([[1, 2, 3]], 2)[0]
    arrays = engine.generate([np.array([1, 2, 3], dtype=np.int32)], 2)[0]
    scalars = engine.generate([[np.int64(1), np.uint16(2), 3]], 2)[0]
    assert ints.token_ids == arrays.token_ids == scalars.token_ids
    assert arrays.prompt == scalars.prompt == (1, 2, 3)
    assert all(type(t) is int for t in arrays.prompt), "tokens are stored as Python ints"


def test_abort_after_the_finish_changes_nothing(tiny_model: Transformer) -> None:
    engine = EngineSpec(4, 16).build(tiny_model)
    rid = engine.generate([[1, 2, 3]], 2)[0].request_id
    before = (engine.manager.state.tree.dump(), engine.kv_cache_stats())
    with pytest.raises(RequestFinishedError, match=rf"abort\(#{rid}\): request #{rid} already "
                                                   r"finished or was aborted; nothing to abort"):
        engine.abort(rid)
    assert (engine.manager.state.tree.dump(), engine.kv_cache_stats()) == before
    assert_clean(engine.manager, "after the refused abort")


IDS.add("abort-finished")


@pytest.mark.parametrize(("kwargs", "message"), cases(
    pytest.param({"attn_backend": "nope"}, r"unknown attention backend 'nope'; supported: "
                 r"flashinfer, star, torch", id="eng-backend"),
    pytest.param({"cuda_graph": True, "attn_backend": "flashinfer", "device": "cuda"},
                 r"Engine: cuda_graph=True needs CUDA, but torch\.cuda\.is_available\(\) is "
                 r"False", id="eng-graph-no-cuda"),
    pytest.param({"max_num_tokens": 0}, r"EngineConfig\.max_num_tokens must be an int >= 1, "
                 r"got 0", id="eng-budget"),
    pytest.param({"max_batch_size": True}, r"EngineConfig\.max_batch_size must be an int "
                 r">= 1, got True", id="eng-batch-bool"),
    pytest.param({"model": "huge"}, r"unknown model preset 'huge'; known: tiny", id="eng-preset"),
    pytest.param({"cache_config": {"tokens_per_block": 4}}, r"Engine: cache_config must be a "
                 r"KvCacheConfig, got \{'tokens_per_block': 4\}", id="eng-config-dict"),
    pytest.param({"model": "hybrid-tiny", "cache_config": KvCacheConfig(
        tokens_per_block=4, max_num_blocks=16, enable_partial_reuse=True)},
        r"enable_partial_reuse=True is unsupported for a model with recurrent layers "
        r"\(layers \[", id="eng-hybrid-partial"),
    pytest.param({"model": "hybrid-tiny", "state_snapshot_interval": 0},
                 r"EngineConfig\.state_snapshot_interval must be an int >= 1, got 0",
                 id="eng-snapshot-interval"),
    pytest.param({"layout": "BLNHC"}, r"EngineConfig\.layout must be one of \('NHD', 'HND', "
                 r"'BLHNC'\), got 'BLNHC'", id="eng-layout"),
    pytest.param({"layout": "BLHNC", "page_size": 3}, r"KvStorage\(BLHNC\): page_size=3 must "
                 r"be a positive divisor of block_size=4", id="eng-packed-page-size"),
    pytest.param({"model": "tiny-swa", "attn_backend": "star", "cache_config": KvCacheConfig(
        tokens_per_block=4, max_num_blocks=16, enable_block_reuse=True)},
        r"enable_block_reuse=True with a sliding-window model \(window 32\) on attention "
        r"backend 'star', which does not support sliding windows", id="eng-window-star-reuse"),
    pytest.param({"cache_config": KvCacheConfig(tokens_per_block=4, max_num_blocks=16,
                                                sliding_window=8)},
                 r"KvCacheConfig\.sliding_window=8, but the model attends without a window",
                 id="eng-window-full-model"),
    pytest.param({"model": "tiny-mixed-swa", "cache_config": KvCacheConfig(
        tokens_per_block=4, max_num_blocks=16, sliding_window=32)},
        r"KvCacheConfig\.sliding_window=32, but some of the model's layers attend without a "
        r"window: their tokens see every earlier block", id="eng-window-mixed-model"),
    pytest.param({"model": "tiny-swa", "cache_config": KvCacheConfig(
        tokens_per_block=4, max_num_blocks=16, sliding_window=16)},
        r"KvCacheConfig\.sliding_window=16 is shorter than the model's window of 32",
        id="eng-window-short"),
    # 2**49 bytes a layer: more than any 64-bit machine can map, so torch always refuses
    pytest.param({"cache_config": KvCacheConfig(tokens_per_block=2**20, max_num_blocks=10**6,
                                                host_cache_blocks=8)},
                 r"Engine: cannot allocate the KV storage on cpu: KvCacheConfig\.max_num_blocks"
                 r"=1000000 device blocks \(4294967296000000 bytes\) and KvCacheConfig\."
                 r"host_cache_blocks=8 host blocks \(34359738368 bytes\), 4294967296 bytes a "
                 r"block; lower them \(torch: .*allocate", id="eng-storage-memory"),
))
def test_bad_engine_options(kwargs: dict[str, Any], message: str) -> None:
    if kwargs.get("cuda_graph") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: cuda_graph=True is valid here")
    options = {"model": "tiny",
               "cache_config": KvCacheConfig(tokens_per_block=4, max_num_blocks=16)} | kwargs
    with pytest.raises(ValueError, match=message):
        Engine(options.pop("model"), options.pop("cache_config"), **options)



def test_an_unknown_engine_option_is_a_type_error_naming_it() -> None:
    cache = KvCacheConfig(tokens_per_block=4, max_num_blocks=16)
    with pytest.raises(TypeError, match=r"Engine\(\) got unknown options \['max_num_tokenz'\]; "
                                        r"the options are EngineConfig's fields: \['attn_backend'"):
        Engine("tiny", cache, max_num_tokenz=64)
    with pytest.raises(TypeError, match=r"Engine\.from_pretrained\(\) got unknown options "
                                        r"\['dtypes'\]"):
        Engine.from_pretrained("nowhere", cache, dtypes="bfloat16")
    with pytest.raises(ValueError, match=r"Engine: engine_config must be an EngineConfig, got "
                                         r"\{'max_num_tokens': 64\}"):
        Engine("tiny", cache, {"max_num_tokens": 64})  # type: ignore[arg-type]


IDS.update({"eng-unknown-option", "eng-engine-config-dict"})


# -- EngineConfig --------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), cases(
    pytest.param({"cuda_graph": True}, r"EngineConfig\.cuda_graph=True needs "
                 r"attn_backend='flashinfer', got 'torch'", id="ecfg-graph-backend"),
    pytest.param({"cuda_graph": True, "attn_backend": "flashinfer"},
                 r"EngineConfig\.cuda_graph=True needs a CUDA device, got device='cpu'",
                 id="ecfg-graph-device"),
    pytest.param({"cuda_graph": True, "attn_backend": "flashinfer", "device": "cuda",
                  "pad_decode": False}, r"EngineConfig\.cuda_graph=True replays decode batches "
                 r"padded to graph_batch_sizes, but pad_decode=False", id="ecfg-graph-no-pad"),
    pytest.param({"pad_decode": True, "graph_batch_sizes": ()}, r"EngineConfig\."
                 r"graph_batch_sizes is empty, but decode batches are padded to its sizes",
                 id="ecfg-graph-sizes-empty"),
    pytest.param({"graph_batch_sizes": (4, 2, 4)}, r"EngineConfig\.graph_batch_sizes must be "
                 r"distinct ints >= 1, got \(4, 2, 4\)", id="ecfg-graph-sizes-repeated"),
    pytest.param({"enable_chunked_prefill": 1}, r"EngineConfig\.enable_chunked_prefill must "
                 r"be True or False, got 1", id="ecfg-flag-int"),
    pytest.param({"pad_decode": "yes"}, r"EngineConfig\.pad_decode must be True, False or "
                 r"None, got 'yes'", id="ecfg-pad-str"),
    pytest.param({"dtype": torch.int8}, r"EngineConfig\.dtype must be one of float32, float16, "
                 r"bfloat16, float64 \(a torch dtype or its name\), got torch\.int8",
                 id="ecfg-dtype-int"),
    pytest.param({"device": "gpu"}, r"EngineConfig\.device='gpu' is not a torch device",
                 id="ecfg-device"),
    pytest.param({"seed": -1}, r"EngineConfig\.seed must be an int in "
                 r"\[0, 18446744073709551615\], got -1", id="ecfg-seed-negative"),
    pytest.param({"page_size": 0}, r"EngineConfig\.page_size must be an int >= 1, got 0",
                 id="ecfg-page-size-zero"),
    pytest.param({"backend_options": {"page_size": 4}}, r"EngineConfig\.backend_options sets "
                 r"\['page_size'\], which the engine passes itself", id="ecfg-backend-option-taken"),
    pytest.param({"backend_options": [("kernel_family", "fa2")]}, r"EngineConfig\."
                 r"backend_options must be a mapping of str keys", id="ecfg-backend-options-list"),
    pytest.param({"attn_backend": int}, r"EngineConfig\.attn_backend class int is not an "
                 r"AttentionBackend", id="ecfg-backend-class"),
))
def test_bad_engine_config(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_engine_config_from_dict_names_unknown_keys_and_source() -> None:
    with pytest.raises(ValueError, match=r"recipe\.json: unknown EngineConfig keys "
                                         r"\['budget'\]; known keys are \['attn_backend'"):
        EngineConfig.from_dict({"budget": 64}, where="recipe.json")
    with pytest.raises(ValueError, match=r"EngineConfig\.dtype must be one of"):
        EngineConfig.from_dict({"dtype": "int8"})


IDS.add("ecfg-unknown-key")

# -- test lists (YAML) ---------------------------------------------------------------------

HEAD = "version: 0.0.1\nl0_cpu:\n- condition:\n    terms:\n      stage: pre_merge\n"
GOOD_TESTS = "  tests:\n  - tests/unit/engine/test_engine.py\n"
# A "billion laughs" list: 8 levels of aliases, 9 each, in ~1 kB (9**8 strings expanded).
ALIAS_BOMB = "version: 0.0.1\nx0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 9)}]\n" for i in range(1, 9)) + HEAD + GOOD_TESTS
# Flat: 20,000 aliases of one 100 kB string.
FLAT_ALIASES = (f"version: 0.0.1\nbig: &big {'x' * 100_000}\nmany: [" + ", ".join(["*big"] * 20_000)
                + "]\n" + HEAD + GOOD_TESTS)
# Nesting far beyond any list's (and Python's recursion limit): a flow sequence 400 deep,
# block sequences 400 deep on one line, and a `-k` of 497 nested parentheses (995 of the
# 1,000 characters an expression may have).
DEEP_FLOW = HEAD + "  tests: " + "[" * 400 + "tests/x.py" + "]" * 400 + "\n"
DEEP_BLOCK = HEAD + "  tests:\n  - " + "- " * 400 + "tests/x.py\n"
DEEP_KEYWORD = HEAD + '  tests:\n  - tests/x.py -k "' + "(" * 497 + "t" + ")" * 497 + '"\n'


@pytest.mark.parametrize(("name", "text", "line", "message"), cases(
    pytest.param("l0_cpu.yml", "version: 0.0.1\nl0_cpu:\n- condition: {terms: {stage: pre_merge}\n"
                 "  tests: [a]\n", 4, r"YAML: ", id="yaml-syntax"),
    pytest.param("l0_cpu.yml", HEAD + GOOD_TESTS + "extra: 1\n", 8,
                 r"unknown top-level key 'extra'", id="yaml-unknown-top-key"),
    pytest.param("l0_cpu.yml", HEAD.replace("pre_merge", "nightly") + GOOD_TESTS, 5,
                 r"stage.*'nightly'", id="yaml-bad-stage"),
    pytest.param("l0_cpu.yml", HEAD + "  tests:\n  - tests/x.py::t TIMEOUT (soon)\n", 7,
                 r"TIMEOUT \(soon\) is not a whole number of minutes in 1\.\.1440",
                 id="yaml-bad-timeout"),
    pytest.param("l0_cpu.yml", HEAD + "    terms:\n      stage: post_merge\n" + GOOD_TESTS, 6,
                 r"duplicate key 'terms' \(first at line 4\)", id="yaml-duplicate-key"),
    pytest.param("cpu_list.yml", HEAD + GOOD_TESTS, None,
                 r"file name 'cpu_list\.yml': a list file is named after its context",
                 id="yaml-file-name"),
    pytest.param("l0_cpu.yml", HEAD + "  tests: []\n", 6, r"tests: .*at least 1 item",
                 id="yaml-empty-tests"),
    pytest.param("l0_cpu.yml", HEAD + "    ranges:\n      system_gpu_count: {gte: 4, lte: 2}\n"
                 + GOOD_TESTS, 7, r"empty range: gte 4 > lte 2", id="yaml-empty-range"),
    pytest.param("l0_cpu.yml", HEAD + "  tests:\n  - /abs/tests/x.py::t\n", 7,
                 r"node id '/abs/tests/x\.py::t': paths are relative to the repository root",
                 id="yaml-absolute-node-id"),
    pytest.param("l0_cpu.yml", HEAD + "  tests:\n  - {test: tests/x.py, timout_seconds: 5}\n", 7,
                 r"unknown key 'timout_seconds'", id="yaml-unknown-entry-key"),
    pytest.param("l0_cpu.yml", HEAD.replace("0.0.1", "9") + GOOD_TESTS, 1, r"version",
                 id="yaml-version"),
    pytest.param("l0_cpu.yml", HEAD + "  order: fastest\n" + GOOD_TESTS, 6,
                 r"l0_cpu\[0\]\.order: Input should be 'fail-first' or 'collection' "
                 r"\(got 'fastest'\)", id="yaml-bad-order"),
    pytest.param("l0_cpu.yml", ALIAS_BOMB, 3,
                 r"YAML: aliases \(\*x0\) are not allowed in list files; write the value out",
                 id="yaml-alias-bomb"),
    pytest.param("l0_cpu.yml", FLAT_ALIASES, 3, r"YAML: aliases \(\*big\) are not allowed",
                 id="yaml-flat-aliases"),
    pytest.param("l0_cpu.yml", HEAD + f"  tests:\n  - tests/x.py::t TIMEOUT ({'9' * 30})\n", 7,
                 r"TIMEOUT \(9{20}\.\.\. \(30 characters\)\) is not a whole number of "
                 r"minutes in 1\.\.1440 \(24 hours\)", id="yaml-timeout-overflow"),
    pytest.param("l0_cpu.yml", HEAD + "    ranges:\n      system_gpu_count: {gte: 1"
                 + "0" * 5000 + "}\n" + GOOD_TESTS, 7,
                 r"YAML: integer of 5001 digits; list numbers have at most 18",
                 id="yaml-long-int"),
    pytest.param("l0_cpu.yml", DEEP_FLOW, 6, r"YAML: sequences and mappings nested more than "
                 r"32 levels deep; at most 32 are read", id="yaml-deep-flow"),
    pytest.param("l0_cpu.yml", DEEP_BLOCK, 7, r"YAML: sequences and mappings nested more than "
                 r"32 levels deep", id="yaml-deep-block"),
    pytest.param("l0_cpu.yml", DEEP_KEYWORD, 7, r"-k '\(\(\(.*: parentheses and 'not' nested "
                 r"more than 32 levels deep; at most 32 are read \(column 33\)",
                 id="yaml-deep-keyword"),
    # \d matches every script's digits: ٣ (Arabic-Indic) and ３ (full width) read as 3.
    pytest.param("l0_cpu.yml", HEAD + "  tests:\n  - tests/x.py::t TIMEOUT (\u0663)\n", 7,
                 r"TIMEOUT \(\u0663\): minutes are written in ASCII digits 0-9",
                 id="yaml-timeout-arabic-digits"),
    pytest.param("l0_cpu.yml", HEAD + "  tests:\n  - tests/x.py::t TIMEOUT (\uff13\uff10)\n", 7,
                 r"TIMEOUT \(\uff13\uff10\): minutes are written in ASCII digits 0-9",
                 id="yaml-timeout-fullwidth-digits"),
    pytest.param("l0_cpu.yml", HEAD + "      backend: torch\n" + GOOD_TESTS, 6,
                 r"terms\.backend: 'torch' is an attention backend; 'backend' is the job's "
                 r"\(TensorRT-LLM's runtime: .*\): write 'attention_backend: torch'",
                 id="yaml-attention-backend-as-backend"),
    pytest.param("l0_cpu.yml", HEAD + "      auto_trigger: [others]\n" + GOOD_TESTS, 6,
                 r"terms\.auto_trigger: a term is one string, number or boolean",
                 id="yaml-term-not-scalar"),
    pytest.param("l0_cpu.yml", HEAD + "  tests:\n  - tests/x.py -m 'gpu and'\n", 7,
                 r"-m 'gpu and': ends early; expected a name, 'not' or '\('",
                 id="yaml-bad-marker-expression"),
    pytest.param("l\u0663_cpu.yml", HEAD.replace("l0_cpu", "l\u0663_cpu") + GOOD_TESTS, None,
                 r"file name 'l\u0663_cpu\.yml': a list file is named after its context: 'l', "
                 r"a level in ASCII digits", id="yaml-context-digits"),
))
def test_broken_test_list(tmp_path: Path, name: str, text: str, line: int | None,
                          message: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ListError, match=message) as info:
        load_test_db(tmp_path)
    where = f"{tmp_path / name}" + ("" if line is None else f":{line}:")
    assert where in str(info.value), f"the message does not point at {where}: {info.value}"


def _symlink_loop(path: Path) -> None:
    path.symlink_to(path.name)


@pytest.mark.parametrize(("name", "make", "line", "message"), cases(
    pytest.param("l0_cpu.yml", lambda p: p.write_bytes(HEAD.encode() + b"  tests: [caf\xe9]\n"),
                 6, r"list file is not UTF-8 text: byte 0xe9 at offset 83",
                 id="list-not-utf8"),
    pytest.param("l0_cpu.yml", Path.mkdir, None, r"list file is a directory, not a file",
                 id="list-directory"),
    pytest.param("l0_cpu.yml", _symlink_loop, None,
                 r"list file is a dangling symlink or a symlink loop", id="list-symlink-loop"),
    pytest.param("l0_cpu.yaml", lambda p: p.write_text(HEAD + GOOD_TESTS), None,
                 r"list files end in \.yml; rename it to l0_cpu\.yml \(a \.yaml file would be "
                 r"ignored\)", id="list-yaml-suffix"),
    pytest.param("l0_cpu.yml", lambda p: p.write_text(HEAD + GOOD_TESTS + "#" * 2_000_000), None,
                 r"list file is larger than 1048576 bytes", id="list-too-large"),
))
def test_unreadable_test_list(tmp_path: Path, name: str, make: Callable[[Path], object],
                              line: int | None, message: str) -> None:
    make(tmp_path / name)
    with pytest.raises(ListError, match=message) as info:
        load_test_db(tmp_path)
    where = f"{tmp_path / name}" + ("" if line is None else f":{line}:")
    assert str(info.value).startswith(where), f"the message does not start with {where}"


@pytest.mark.parametrize(("make", "message"), cases(
    pytest.param(Path.mkdir, r"waives\.txt: waives file is a directory, not a file",
                 id="waives-directory"),
    pytest.param(lambda p: p.write_bytes(b"tests/x.py SKIP (\xff)\n"),
                 r"waives\.txt:1: waives file is not UTF-8 text: byte 0xff at offset 17",
                 id="waives-not-utf8"),
))
def test_unreadable_waives_file(tmp_path: Path, make: Callable[[Path], object],
                                message: str) -> None:
    make(tmp_path / "waives.txt")
    # The default next to a test-db is taken whatever it is, never silently skipped.
    found = default_waives(tmp_path / "test-db")
    assert found == tmp_path / "waives.txt"
    with pytest.raises(ListError) as info:
        load_waives(found)
    assert re.search(message, str(info.value)) and str(info.value).startswith(str(found))


@pytest.mark.parametrize(("text", "message"), cases(
    pytest.param("{not json", r"reuse_report\.json: not a readable reuse report: Expecting "
                 r"property name", id="report-broken-json"),
    pytest.param('{"records": [{"scenario": "s", "test_id": "t", "params": 3, "stats": {}, '
                 '"expected": null, "passed": true}]}',
                 r"reuse_report\.json: malformed reuse record", id="report-bad-record"),
    pytest.param('{"records":\n' + "[" * 100_000, r"reuse_report\.json:2: not a readable reuse "
                 r"report: arrays and objects nested more than 32 levels deep; at most 32 are "
                 r"read", id="report-deep-json"),
))
def test_broken_reuse_report(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                             message: str) -> None:
    (tmp_path / "reuse_report.json").write_text(text)
    assert kvharness(["report", "--results-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"kvharness report: {re.escape(str(tmp_path))}/{message}", err), err


@pytest.mark.parametrize(("text", "message"), cases(
    pytest.param('{"m1": ["tests/x.py::t"]}', r'a kill record is \{"mutants": ',
                 id="kills-no-mutants"),
    pytest.param('{"mutants": {"m1": "tests/x.py::t"}}', r"mutant 'm1': the tests that killed "
                 r"it are a list of node ids \(got 'tests/x\.py::t'\)", id="kills-not-a-list"),
))
def test_broken_kill_record(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / ".test_kills.json").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_kills(tmp_path / ".test_kills.json")
    assert str(info.value).startswith(f"{tmp_path / '.test_kills.json'}: ")


# -- kvharness flags -----------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), cases(
    pytest.param([], r"the following arguments are required: COMMAND", id="cli-no-command"),
    pytest.param(["frobnicate"], r"invalid choice: 'frobnicate'", id="cli-unknown-command"),
    pytest.param(["list", "--stage", "nightly"], r"argument --stage: invalid choice: 'nightly'",
                 id="cli-bad-stage"),
    pytest.param(["list", "--gpu-count", "two"], r"argument --gpu-count: gpu count 'two' is not "
                 r"an integer", id="cli-gpu-count-text"),
    pytest.param(["list", "--gpu-count", "-1"], r"argument --gpu-count: gpu count -1 is negative",
                 id="cli-gpu-count-negative"),
    pytest.param(["list", "--gpu", " "], r"argument --gpu: gpu name is empty", id="cli-gpu-empty"),
    pytest.param(["list", "--backend", "cuda"], r"argument --backend: invalid choice: 'cuda'",
                 id="cli-bad-backend"),
    pytest.param(["list", "--frobnicate"], r"unrecognized arguments: --frobnicate",
                 id="cli-unknown-flag"),
    pytest.param(["list", "--job", "backend"], r"argument --job: job term 'backend' is not "
                 r"KEY=VALUE", id="cli-job-not-key-value"),
    pytest.param(["sysinfo", "--job", "stage=post_merge"], r"argument --job: job term 'stage' "
                 r"is the machine's; its flag sets it \(--stage\)", id="cli-job-machine-key"),
    pytest.param(["list", "--distribution", "red hat"], r"argument --distribution: distribution "
                 r"'red hat': one word", id="cli-distribution-words"),
    pytest.param(["test-db", "-d", "x", "--match", "{}", "--match-exact", "{}"],
                 r"argument --match-exact: not allowed with argument --match",
                 id="cli-test-db-both-matches"),
    # A line break in a value would print a Mako option line of its own (`stage=...`).
    pytest.param(["sysinfo", "--job", "x=a\nstage=post_merge"], r"argument --job: job term "
                 r"'x=a\\nstage=post_merge' holds a control character \(U\+000A\); a value is "
                 r"printed on one line", id="cli-job-newline"),
    pytest.param(["sysinfo", "--job", "a\rb=1"], r"argument --job: job term 'a\\rb=1' holds a "
                 r"control character \(U\+000D\)", id="cli-job-key-control"),
    pytest.param(["sysinfo", "--gpu", "H100\nstage=post_merge"], r"argument --gpu: gpu name "
                 r"'H100\\nstage=post_merge' holds a control character \(U\+000A\)",
                 id="cli-gpu-newline"),
))
def test_bad_cli_flags_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                              message: str) -> None:
    with pytest.raises(SystemExit) as info:
        kvharness(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), f"stderr lacks {message!r}:\n{err}"


@pytest.mark.parametrize(("files", "message"), cases(
    pytest.param({}, r"kvharness list: .*nope: test-db folder does not exist",
                 id="cli-missing-test-db"),
    pytest.param({"l0_cpu.yml": HEAD.replace("pre_merge", "nightly") + GOOD_TESTS},
                 r"kvharness list: .*l0_cpu\.yml:5: .*'nightly'", id="cli-broken-list"),
    pytest.param({"l0_cpu.yml": ALIAS_BOMB}, r"kvharness list: .*l0_cpu\.yml:3: YAML: aliases",
                 id="cli-alias-bomb"),
    pytest.param({"l0_cpu.yml": DEEP_FLOW}, r"kvharness list: .*l0_cpu\.yml:6: YAML: sequences "
                 r"and mappings nested more than 32 levels deep", id="cli-deep-list"),
    # The run's stage is pre_merge: a list of post_merge blocks selects nothing for it.
    pytest.param({"l0_cpu.yml": HEAD.replace("pre_merge", "post_merge") + GOOD_TESTS},
                 r"kvharness list: no block of .* applies to stage=pre_merge .*\n  l0_cpu\[0\] "
                 r"\(.*l0_cpu\.yml:3\): stage pre_merge, block wants post_merge\n",
                 id="cli-list-nothing-applies"),
))
def test_cli_reports_broken_lists_with_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    folder = tmp_path if files else tmp_path / "nope"
    assert kvharness(["list", "--test-db", str(folder)]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), f"stderr lacks {message!r}:\n{err}"


@pytest.mark.parametrize("context", cases(
    pytest.param("../other/l0_zz", id="cli-test-db-context-path"),
    pytest.param("/abs/other/l0_zz", id="cli-test-db-context-absolute"),
    pytest.param("l0_cpu.yml", id="cli-test-db-context-file-name"),
))
def test_a_context_is_a_bare_list_name(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       context: str) -> None:
    # A list outside -d that would render if the context were a path.
    (tmp_path / "db").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "l0_zz.yml").write_text(HEAD.replace("l0_cpu", "l0_zz") + GOOD_TESTS)
    if context.startswith("/abs"):
        context = str(tmp_path / "other" / "l0_zz")
    assert kvharness(["test-db", "-d", str(tmp_path / "db"), "--context", context]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # nothing rendered
    assert f"kvharness test-db: {tmp_path / 'db'}: context {context!r}: a context is a bare " \
        "list name: 'l', a level in ASCII digits, '_', the machine kind in [a-z0-9_], " \
        "e.g. l0_h100" in err, err


def test_sysinfo_refuses_a_control_character_in_any_value() -> None:
    from harness.lists.testdb import mako_lines

    # what the system reports (the host name, /etc/os-release) is checked as the flags are
    with pytest.raises(ValueError, match=r"sysinfo: hostname 'a\\nstage=post_merge' holds a "
                                         r"control character \(U\+000A\)"):
        mako_lines({"gpu": "H100", "hostname": "a\nstage=post_merge"})


IDS.add("sysinfo-value-control")


@pytest.mark.parametrize(("match", "message"), cases(
    pytest.param('{"gpu": "H100"', r"kvharness test-db: --match: not JSON: Expecting ',' "
                 r"delimiter", id="cli-test-db-not-json"),
    pytest.param('["H100"]', r"kvharness test-db: --match: the description is a JSON object of "
                 r"key: value, got list", id="cli-test-db-not-an-object"),
    pytest.param('{"gpu": ["H100"]}', r"kvharness test-db: --match: 'gpu' is \[\"H100\"\]; a "
                 r"description's values are strings, numbers, booleans or null",
                 id="cli-test-db-nested-value"),
))
def test_test_db_refuses_a_bad_description_with_exit_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], match: str, message: str) -> None:
    (tmp_path / "l0_cpu.yml").write_text(HEAD + GOOD_TESTS)
    out = tmp_path / "out.txt"
    assert kvharness(["test-db", "-d", str(tmp_path), "--output", str(out), "--match", match]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), f"stderr lacks {message!r}:\n{err}"
    assert not out.exists()  # nothing written


# -- checkpoints ---------------------------------------------------------------------------

WEIGHTS = "model.safetensors"
Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="session")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid 2-layer checkpoint, written once; cases corrupt copies of it."""
    path = tmp_path_factory.mktemp("pristine")
    save_pretrained(Transformer(replace(get_preset("tiny"), num_layers=2, layer_types=())), path)
    return path


def edit_tensors(fn: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        tensors = load_file(path / WEIGHTS)
        fn(tensors)
        save_file(tensors, path / WEIGHTS)
    return apply


def edit_config(**changes: Any) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        raw.update(changes)
        for key in [k for k, v in changes.items() if v is None]:
            del raw[key]
        (path / "config.json").write_text(json.dumps(raw))
    return apply


def write(name: str, text: str) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        (path / name).write_text(text)
    return apply


def remove(name: str) -> Callable[[Path], None]:
    return lambda path: (path / name).unlink()


def write_bytes(name: str, data: bytes) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        (path / name).write_bytes(data)
    return apply


def replace_by_folder(name: str) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        (path / name).unlink()
        (path / name).mkdir()
    return apply


def write_index(weight_map: dict[str, Any]) -> Callable[[Path], None]:
    return write("model.safetensors.index.json", json.dumps({"weight_map": weight_map}))


def load_instead(name: str) -> Callable[[Path], Path]:
    """Load `name` (inside the checkpoint, or beside it) instead of the folder."""
    return lambda path: path / name


def non_finite(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.norm.weight"][3] = float("nan")
    tensors[Q0][0, :2] = torch.tensor([float("inf"), -float("inf")])


@pytest.mark.parametrize(("corrupt", "error", "message"), cases(
    pytest.param(edit_tensors(lambda t: t.pop(Q0)), CheckpointError,
                 rf"tensor '{Q0}' is missing: expected shape \[256, 128\]", id="ck-missing-tensor"),
    pytest.param(edit_tensors(lambda t: t.update({Q0: t[Q0].T.contiguous()})), CheckpointError,
                 rf"tensor '{Q0}' in .*{WEIGHTS}: expected shape \[256, 128\], got \[128, 256\]",
                 id="ck-wrong-shape"),
    pytest.param(edit_tensors(lambda t: t.update({"model.norm.weight": torch.ones(128,
                 dtype=torch.int64)})), CheckpointError, r"tensor 'model\.norm\.weight' in .*: "
                 r"expected dtype one of \['BF16', 'F16', 'F32'\], got I64", id="ck-wrong-dtype"),
    pytest.param(edit_tensors(lambda t: t.update({"model.layers.7.extra": torch.ones(2)})),
                 CheckpointError, r"tensor 'model\.layers\.7\.extra' in .* is unexpected for "
                 r"this config", id="ck-unexpected-tensor"),
    pytest.param(edit_config(num_hidden_layers=3), CheckpointError,
                 rf"config\.json: num_hidden_layers=3, but the weights in \['.*{WEIGHTS}'\] "
                 r"hold layers 0 to 1$", id="ck-config-more-layers"),
    pytest.param(edit_config(num_hidden_layers=2_000_000), CheckpointError,
                 r"config\.json: num_hidden_layers=2000000 exceeds the limit of 1024",
                 id="ck-huge-layers"),
    pytest.param(edit_config(max_position_embeddings=10**12), CheckpointError,
                 r"config\.json: max_position_embeddings=1000000000000 exceeds the limit of "
                 r"2147483647", id="ck-huge-positions"),
    pytest.param(edit_config(max_position_embeddings=1e12), CheckpointError,
                 r"config\.json: max_position_embeddings=1000000000000\.0 exceeds the limit",
                 id="ck-huge-positions-float"),
    pytest.param(edit_config(rope_theta=float("inf"), rope_parameters=None), CheckpointError,
                 r"config\.json: ModelConfig\.rope_theta=inf must be a positive finite number",
                 id="ck-rope-theta-inf"),
    pytest.param(edit_config(rms_norm_eps=float("inf")), CheckpointError,
                 r"config\.json: ModelConfig\.rms_norm_eps=inf must be a positive finite "
                 r"number", id="ck-rms-eps-inf"),
    pytest.param(edit_config(num_key_value_heads=0), CheckpointError,
                 r"config\.json: num_key_value_heads must be an int >= 1, got 0",
                 id="ck-kv-heads-zero"),
    pytest.param(edit_config(head_dim=0), CheckpointError,
                 r"config\.json: head_dim must be an int >= 1, got 0",
                 id="ck-head-dim-zero"),
    pytest.param(edit_config(model_type="kvcache_hybrid", layer_types=4), CheckpointError,
                 r"config\.json: layer_types=4 must be a list", id="ck-layer-types-int"),
    pytest.param(write_bytes("config.json", b'{"model_type": "llama", "name": "caf\xe9"}'),
                 CheckpointError, r"config\.json: not UTF-8 text: 'utf-8' codec can't decode "
                 r"byte 0xe9", id="ck-config-not-utf8"),
    pytest.param(write_index({"model.norm.weight": ["model.safetensors"]}), CheckpointError,
                 r"index\.json: weight_map values must be file names \(strings\), got "
                 r"\{'model\.norm\.weight': \['model\.safetensors'\]\}",
                 id="ck-index-list-value"),
    pytest.param(write_index({"model.norm.weight": WEIGHTS, Q0: 3}), CheckpointError,
                 rf"index\.json: weight_map values must be file names \(strings\), got "
                 rf"\{{'{Q0}': 3\}}", id="ck-index-mixed-values"),
    pytest.param(replace_by_folder(WEIGHTS), CheckpointError,
                 rf"{WEIGHTS}: a folder, not a safetensors file", id="ck-weights-folder"),
    pytest.param(load_instead(WEIGHTS), CheckpointError,
                 rf"{WEIGHTS}: expected a checkpoint folder or its config\.json, got another "
                 r"file", id="ck-path-other-file"),
    pytest.param(load_instead("nope"), FileNotFoundError,
                 r"nope: no such checkpoint folder", id="ck-no-folder"),
    pytest.param(edit_tensors(non_finite), CheckpointError,
                 r"non-finite weights \(load with check_finite=False to skip this check\):\n"
                 rf"  tensor '{Q0}' in .*{WEIGHTS}: 0 NaN and 2 infinite values \(read as "
                 r"torch\.float32\)\n  tensor 'model\.norm\.weight' in .*: 1 NaN and 0 "
                 r"infinite values", id="ck-non-finite-weights"),
    pytest.param(edit_config(intermediate_size=200), CheckpointError,
                 r"mlp\.gate_proj\.weight' in .*: expected shape \[200, 128\], got \[256, 128\]",
                 id="ck-config-shapes"),
    pytest.param(edit_config(num_attention_heads=3), CheckpointError,
                 r"config\.json: num_attention_heads=3 is not a multiple of "
                 r"num_key_value_heads=2",
                 id="ck-config-heads"),
    pytest.param(edit_config(model_type="gpt2"), CheckpointError,
                 r"config\.json: model_type='gpt2' is not supported", id="ck-model-type"),
    pytest.param(edit_config(vocab_size=None), CheckpointError,
                 r"config\.json: required key 'vocab_size' is missing", id="ck-missing-key"),
    pytest.param(edit_config(hidden_act="gelu"), CheckpointError,
                 r"config\.json: hidden_act='gelu'; only 'silu' is supported", id="ck-hidden-act"),
    pytest.param(edit_config(rope_scaling={"rope_type": "linear", "factor": 2.0}),
                 CheckpointError, r"config\.json: rope_scaling=.*linear.* is not supported",
                 id="ck-rope-scaling"),
    pytest.param(write("config.json", "{'model_type': llama"), CheckpointError,
                 r"config\.json: not valid JSON", id="ck-config-not-json"),
    pytest.param(remove("config.json"), FileNotFoundError,
                 r"config\.json: no such file \(an HF checkpoint needs config\.json\)",
                 id="ck-no-config"),
    pytest.param(remove(WEIGHTS), FileNotFoundError, r": no \*\.safetensors weight files",
                 id="ck-no-weights"),
    pytest.param(write(WEIGHTS, "not a safetensors file"), CheckpointError,
                 rf"{WEIGHTS}: not a readable safetensors file: ", id="ck-garbage-weights"),
))
def test_corrupt_checkpoint(tmp_path: Path, pristine: Path,
                            corrupt: Callable[[Path], Path | None], error: type[Exception],
                            message: str) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(pristine, path)
    load = corrupt(path) or path
    with pytest.raises(error, match=message) as info:
        Engine.from_pretrained(load, KvCacheConfig(tokens_per_block=4, max_num_blocks=16))
    assert str(path) in str(info.value), f"the message names no file under {path}"


@pytest.mark.parametrize("corrupt", [
    pytest.param(edit_config(vocab_size=None), id="missing-key"),
    pytest.param(edit_config(rope_scaling={"rope_type": "linear"}), id="rope-scaling"),
])
def test_config_errors_name_the_file_once(tmp_path: Path, pristine: Path,
                                          corrupt: Callable[[Path], None]) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(pristine, path)
    corrupt(path)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(path)
    assert str(info.value).count(str(path / "config.json")) == 1, str(info.value)


def test_checkpoint_load_with_integer_dtype(pristine: Path) -> None:
    with pytest.raises(ValueError, match=r"load_pretrained\(dtype=torch\.int8\): expected a "
                                         r"floating dtype"):
        load_pretrained(pristine, dtype=torch.int8)


IDS.add("ck-int-dtype")


# -- kvharness conform ----------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "message"), cases(
    pytest.param("vllm>=0.30", r"engine spec 'vllm>=0\.30': expected NAME, NAME==VERSION or "
                 r"NAME@PATH", id="conform-spec-range"),
    pytest.param("vllm==0.33.1.dev3+gabc1234", r"vllm 0\.33\.1\.dev3\+gabc1234 is not a "
                 r"registry release: run a checkout as vllm@PATH, or the one installed here "
                 r"as a bare vllm", id="conform-version-dev"),
    pytest.param("sglang@/nonexistent/sglang", r"/nonexistent/sglang: no sglang/__init__\.py "
                 r"here or under /nonexistent/sglang/python", id="conform-tree-missing"),
    pytest.param("lmdeploy==0.9.0", r"no adapter for 'lmdeploy'; engines: sglang, "
                 r"sglang_unified, shortfin, vllm, kvcache", id="conform-engine-unknown"),
    pytest.param("tensorrt_llm==1.2.1", r"tensorrt_llm cannot run on this machine: "
                 r"TensorRT-LLM's wheels are not on the package registry .* builds CUDA "
                 r"objects", id="conform-engine-not-runnable-here"),
))
def test_conform_that_cannot_run_is_exit_2(tmp_path: Path, spec: str, message: str) -> None:
    assert kvharness(["conform", spec, "--report", str(tmp_path), "--seeds", "0"]) == 2
    reason = json.loads((tmp_path / "report.json").read_text())["reason"]
    assert re.match(message, reason), reason
    assert reason in (tmp_path / "report.md").read_text()


def test_conform_refuses_a_version_that_would_not_run(tmp_path: Path) -> None:
    from harness.conform.adapters.kvcache import kvcache_version

    assert kvharness(["conform", "kvcache==999.0.0", "--report", str(tmp_path)]) == 2
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["reason"] == (f"kvcache 999.0.0 is not the kvcache that would run: this "
                              f"checkout's is {kvcache_version()} (kvcache or "
                              f"kvcache=={kvcache_version()})")
    assert data["checks"] == []


IDS.add("conform-kvcache-version")


def test_a_window_pool_sglangs_server_would_refuse_is_refused_by_name() -> None:
    from types import SimpleNamespace

    from harness.conform.adapters import sglang_options
    from harness.conform.adapters.sglang_unified import contract as unified_contract
    from harness.conform.adapters.sglang_window import window_pool_tokens
    from harness.conform.protocol import CacheOptions

    with pytest.raises(ValueError, match=re.escape(
            "CacheOptions.window_pool 3 (12 tokens) cannot hold one request: SGLang refuses "
            "a window pool of at most the window (8) plus a page (4)")):
        window_pool_tokens(3, 32, 4, 8)
    with pytest.raises(ValueError, match=re.escape(
            "CacheOptions.window_pool 33 is larger than the full pool (32 blocks): SGLang's "
            "swa_full_tokens_ratio must lie in (0, 1]")):
        window_pool_tokens(33, 32, 4, 8)
    names = SimpleNamespace(swa=("pool", "allocator", "SWA"), mamba=None, hicache=False)
    with pytest.raises(ValueError, match=re.escape(
            "CacheOptions.window_pool 8 sizes a window's pool, but no window was asked for")):
        sglang_options.scheduled(None, names, "unified",  # type: ignore[arg-type]
                                 unified_contract("0.5.23", 4), 32, 4, False,
                                 CacheOptions(window_pool=8))


IDS.add("conform-window-pool-small")


@pytest.mark.parametrize("spec", cases(
    pytest.param("ABS", id="conform-spec-absolute-path"),
    pytest.param("../../../x", id="conform-spec-relative-path"),
    pytest.param("kvcache" + "a" * 5000, id="conform-spec-too-long"),
))
def test_conform_writes_nothing_where_a_bad_spec_points(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        spec: str) -> None:
    cwd = tmp_path / "a" / "b" / "c"  # ../../../x is tmp_path/x
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    spec = spec.replace("ABS", str(tmp_path / "some" / "dir"))
    assert kvharness(["conform", spec, "--seeds", "0"]) == 2
    out = capsys.readouterr().out
    if len(spec) > 100:
        assert f"engine spec {spec[:40]!r}... of {len(spec)} characters; at most 100" in out
    else:
        assert f"engine spec {spec!r}: expected NAME, NAME==VERSION or NAME@PATH" in out
    assert "no report (the SPEC names no engine to file it under)" in out
    # the folder the SPEC names, and every other, stays as it was: no report anywhere
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == [
        Path("a"), Path("a/b"), Path("a/b/c")]


@pytest.mark.parametrize(("make", "why"), cases(
    pytest.param(lambda d: (d.parent.mkdir(), d.write_text("keep me")),
                 "is a file, not a folder", id="conform-report-file"),
    pytest.param(lambda d: d.parent.write_text("keep me"), "Not a directory",
                 id="conform-report-under-a-file"),
    pytest.param(lambda d: (d / "report.json").mkdir(parents=True),
                 "report.json is not a file", id="conform-report-json-folder"),
    pytest.param(lambda d: None, "File name too long", id="conform-report-too-long"),
))
def test_conform_checks_the_report_folder_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Callable[[Path], object],
        why: str) -> None:
    folder = tmp_path / "out" / "rep"
    if why == "File name too long":
        folder = tmp_path / ("x" * 5000)
    make(folder)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert kvharness(["conform", "kvcache", "--report", str(folder)]) == 2
    out = capsys.readouterr().out
    shown = str(folder) if len(str(folder)) <= 200 else \
        f"{str(folder)[:120]}... ({len(str(folder))} characters)"
    assert out == f"kvcache: exit 2 (report folder {shown}: {why}); nothing ran\n"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_conform_seeds_must_be_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        kvharness(["conform", "kvcache", "--seeds", "-1"])
    assert info.value.code == 2
    assert "argument --seeds: expected an int >= 0, got '-1'" in capsys.readouterr().err


IDS.add("conform-seeds-negative")


def test_conform_lock_needs_a_release(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvharness(["conform", "lock", "vllm"]) == 2
    assert "cannot lock vllm: vllm: name the release to lock (vllm==VERSION)" in \
        capsys.readouterr().out


IDS.add("conform-lock-bare")


def test_conform_replay_names_the_bad_op(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "check.json"
    file.write_text(json.dumps({"num_blocks": 8, "ops": [
        {"kind": "free", "seq": "A", "tokens": [1]}]}))
    assert kvharness(["conform", "kvcache", "--replay", str(file)]) == 2
    assert f"{file}: ops[0]: a free op: unknown keys ['tokens']; known: kind, seq" in \
        capsys.readouterr().out


IDS.add("conform-replay-bad-op")


def test_conform_replay_names_a_bad_extra_key(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "check.json"
    file.write_text(json.dumps({"num_blocks": 8, "ops": [
        {"kind": "admit", "seq": "A", "tokens": [1, 2], "scope": {"extra_key": ""}}]}))
    assert kvharness(["conform", "kvcache", "--replay", str(file)]) == 2
    assert f"{file}: ops[0]: scope: Scope.extra_key must be a non-empty str or None, " \
           "got ''" in capsys.readouterr().out


IDS.add("conform-replay-bad-extra-key")


def test_conform_replay_names_bad_cache_options(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "check.json"
    file.write_text(json.dumps({"num_blocks": 8, "ops": [], "options": {"window": 0}}))
    assert kvharness(["conform", "kvcache", "--replay", str(file)]) == 2
    assert f"{file}: options: CacheOptions.window must be an int >= 1 or None, got 0" in \
        capsys.readouterr().out
    file.write_text(json.dumps({"num_blocks": 8, "ops": [], "options": {"chunk_budget": 8}}))
    assert kvharness(["conform", "kvcache", "--replay", str(file)]) == 2
    assert "does not honour the cache options ['chunk_budget'] (it honours ['host_blocks', " \
           "'state_interval'])" in capsys.readouterr().out


IDS.update({"conform-replay-bad-options", "conform-replay-unhonoured-options"})


def test_conform_lock_pinning_torch_is_refused(tmp_path: Path) -> None:
    from harness.conform.controller.locks import LOCK_DIR, LockError, parse_lock

    good = json.loads((LOCK_DIR / "sglang-0.5.23.json").read_text())
    with pytest.raises(LockError, match=r"sglang-0\.5\.23\.json: deps: 'torch==2\.14\.1': "
                                        r"torch comes from the harness's interpreter"):
        parse_lock({**good, "deps": ["torch==2.14.1"]}, LOCK_DIR / "sglang-0.5.23.json")


IDS.add("conform-lock-torch")


def _lock_with(**changes: object) -> dict[str, object]:
    from harness.conform.controller.locks import LOCK_DIR

    return {**json.loads((LOCK_DIR / "sglang-0.5.23.json").read_text()), **changes}


@pytest.mark.parametrize(("change", "message"), cases(
    pytest.param({"extra": 1}, r"unknown keys \['extra'\], missing keys \[\]",
                 id="conform-lock-unknown-key"),
    pytest.param({"engine": "tensorrt_llm"}, r"engine: 'tensorrt_llm' has no adapter; "
                 r"known: \['sglang', 'sglang_unified', 'shortfin', 'vllm'\]",
                 id="conform-lock-engine"),
    pytest.param({"version": "0.5.22"}, r"file name: should be sglang-0\.5\.22\.json",
                 id="conform-lock-file-name"),
    pytest.param({"wheel": {"file": "sglang-0.5.23-py3-none-any.whl", "sha256": "ABC",
                            "bytes": 1}},
                 r"wheel\.sha256: expected 64 lowercase hex digits", id="conform-lock-sha256"),
    pytest.param({"deps": ["requests>=2"]}, r"deps: 'requests>=2' is not a name==version pin",
                 id="conform-lock-pin"),
    pytest.param({"deps": ["idna==3.10", "idna==3.11"]}, r"deps: a package is pinned twice",
                 id="conform-lock-pinned-twice"),
    pytest.param({"stubs": {"absent": {}, "magic": {}}}, r"stubs: unknown keys \['magic'\]",
                 id="conform-lock-stubs-key"),
    pytest.param({"version": "latest"}, r"version: 'latest' is not a version like 0\.33\.0",
                 id="conform-lock-version"),
    pytest.param({"stubs": {**_lock_with()["stubs"], "overrides": ["transformers.utils"]}},
                 r"stubs: stubs\.overrides: 'transformers\.utils' is not an override the "
                 r"harness knows; known: \['transformers-torchvision-backend'\]",
                 id="conform-lock-override"),
    pytest.param({"stubs": {**_lock_with()["stubs"], "prime": [],
                            "overrides": ["transformers-torchvision-backend"]}},
                 r"stubs: stubs\.overrides: 'transformers-torchvision-backend' needs "
                 r"'torchvision' raising and primed", id="conform-lock-override-unprimed"),
    pytest.param({"resolved": {"how": "pip", "module": "os"}}, r"resolved: expected an object "
                 r"with keys among \['added', 'base', 'date', 'how', 'pip', 'python'\]",
                 id="conform-lock-resolved"),
))
def test_conform_lock_fields_are_checked(change: dict[str, object], message: str) -> None:
    from harness.conform.controller.locks import LOCK_DIR, LockError, parse_lock

    path = LOCK_DIR / "sglang-0.5.23.json"
    with pytest.raises(LockError, match=re.escape(str(path)) + ": " + message):
        parse_lock(_lock_with(**change), path)


def test_conform_unknown_check_is_exit_2(tmp_path: Path) -> None:
    assert kvharness(["conform", "kvcache", "--check", "nosuch", "--report",
                      str(tmp_path)]) == 2
    reason = json.loads((tmp_path / "report.json").read_text())["reason"]
    assert reason.startswith("unknown check 'nosuch'; known: ['cold_then_warm', ")


IDS.add("conform-check-unknown")


def test_conform_replay_of_a_missing_file_is_exit_2(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "gone.json"
    assert kvharness(["conform", "kvcache", "--replay", str(file)]) == 2
    assert f"{file}: not a readable replay file or report.json: [Errno 2] No such file or " \
        "directory" in capsys.readouterr().out


IDS.add("conform-replay-missing")


def test_conform_worker_imports_no_named_module() -> None:
    import io

    from harness.conform.worker.serve import serve

    out = io.StringIO()
    serve(io.StringIO(json.dumps({"cmd": "load", "engine": "harness.conform.adapters.kvcache"})
                      + "\n"), out)
    reply = json.loads(out.getvalue())
    assert reply["ok"] is False
    assert reply["error"] == ("ValueError: no adapter for engine "
                              "'harness.conform.adapters.kvcache'; known: ['sglang', "
                              "'sglang_unified', 'shortfin', 'vllm']")


IDS.add("conform-worker-module")


# -- the document --------------------------------------------------------------------------

def test_catalogue_is_documented() -> None:
    documented = set(re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), re.MULTILINE))
    assert len(IDS) >= 30 and len(REPRO_IDS) >= 25
    # the repro files' cases are checked in tests/reliability/test_hostile_repro.py, the
    # plugin's shard flags in tests/harness/plugin/test_sharding.py, the worker's replies
    # in tests/harness/conform/test_worker.py, conform's replay files in
    # tests/harness/conform/test_replay.py, the mutation tools' paths in
    # tests/tools/test_mutants.py and test_generic_mutants.py
    checked = IDS | REPRO_IDS | SHARD_IDS | WORKER_IDS | REPLAY_IDS | MUTANT_IDS | GENERIC_IDS
    assert checked - documented == set(), f"cases missing from {DOC}"
    assert documented - checked == set(), f"{DOC} documents cases that no test checks"

"""KvCacheConfig validation and the effective (auto-resolved) reuse flags."""

from __future__ import annotations

import re

import pytest

from kvcache import KvCacheConfig, ReuseScope
from kvcache.core.keys import scope_key


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"tokens_per_block": 0}, "tokens_per_block must be an int >= 1, got 0", id="tpb-0"),
        pytest.param({"tokens_per_block": -4}, "tokens_per_block must be an int >= 1", id="tpb-neg"),
        pytest.param({"tokens_per_block": True}, "tokens_per_block must be an int", id="tpb-bool"),
        pytest.param({"tokens_per_block": 16.0}, "tokens_per_block must be an int", id="tpb-float"),
        pytest.param({"max_num_blocks": 0}, "max_num_blocks must be an int in [1, 2147483647], got 0",
                     id="blocks-0"),
        pytest.param({"enable_block_reuse": 1}, "enable_block_reuse must be True, False or None",
                     id="reuse-int"),
        pytest.param({"enable_block_reuse": False, "enable_partial_reuse": True},
                     "enable_partial_reuse=True needs block reuse", id="partial-no-reuse"),
        pytest.param({"enable_partial_reuse": False, "copy_on_partial_reuse": True},
                     "copy_on_partial_reuse=True needs partial reuse", id="copy-no-partial"),
        pytest.param({"enable_block_reuse": False, "copy_on_partial_reuse": True},
                     "copy_on_partial_reuse=True needs partial reuse", id="copy-no-reuse"),
        pytest.param({"host_cache_blocks": -1}, "host_cache_blocks must be an int in [0, 2147483647], got -1",
                     id="host-neg"),
        pytest.param({"host_cache_blocks": 2.0}, "host_cache_blocks must be an int", id="host-float"),
        pytest.param({"enable_block_reuse": False, "host_cache_blocks": 8},
                     "host_cache_blocks=8 keeps evicted cached blocks for reuse, but "
                     "enable_block_reuse=False caches nothing", id="host-no-reuse"),
    ],
)
def test_invalid_config_names_field_and_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        KvCacheConfig(**kwargs)  # type: ignore[arg-type]


def test_pool_sizes_are_bounded_by_an_int32_block_id() -> None:
    """Issue 22: a size past 2**31 - 1 (an int32 page index) is refused naming its field,
    never handed to the pool to die in an OverflowError; the bound itself is accepted."""
    top = KvCacheConfig(max_num_blocks=2**31 - 1, host_cache_blocks=2**31 - 1)
    assert (top.max_num_blocks, top.host_cache_blocks) == (2**31 - 1, 2**31 - 1)
    for field in ("max_num_blocks", "host_cache_blocks"):
        with pytest.raises(ValueError, match=rf"KvCacheConfig\.{field} must be an int in "
                                             rf"\[\d, 2147483647\], got 2147483648$"):
            KvCacheConfig(**{field: 2**31})


def test_auto_flags_resolve() -> None:
    auto = KvCacheConfig()
    assert (auto.block_reuse, auto.partial_reuse, auto.copy_on_partial) == (True, True, True)
    off = KvCacheConfig(enable_block_reuse=False)
    assert (off.block_reuse, off.partial_reuse, off.copy_on_partial) == (False, False, False)
    no_copy = KvCacheConfig(copy_on_partial_reuse=False)
    assert (no_copy.partial_reuse, no_copy.copy_on_partial) == (True, False)
    resolved = KvCacheConfig(enable_block_reuse=True, enable_partial_reuse=True,
                             copy_on_partial_reuse=True).without_reuse()
    assert not resolved.block_reuse and not resolved.partial_reuse
    hosted = KvCacheConfig(host_cache_blocks=64)
    assert hosted.host_cache_blocks == 64 and hosted.without_reuse().host_cache_blocks == 0


def test_from_dict_rejects_unknown_keys() -> None:
    assert KvCacheConfig.from_dict({"tokens_per_block": 8}).tokens_per_block == 8
    with pytest.raises(ValueError, match=r"cfg.yml: unknown KvCacheConfig keys \['tokens_per_blok'\]"):
        KvCacheConfig.from_dict({"tokens_per_blok": 8}, where="cfg.yml")


def test_scope_keys() -> None:
    assert scope_key(None) is None
    assert scope_key(ReuseScope()) is None
    assert scope_key(ReuseScope(salt=0)) == (0, None)
    assert scope_key(ReuseScope(salt=0)) != scope_key(ReuseScope(salt=None))
    assert scope_key(ReuseScope(lora_id=3)) == (None, 3)
    with pytest.raises(ValueError, match="expected None or ReuseScope, got 'salty'"):
        scope_key("salty")  # type: ignore[arg-type]

"""The tree's byte keys: token conversion (bools rejected exactly) and common prefixes.

Both are hot-path shortcuts over C-level byte operations; these properties pin them to
the plain definitions they replace.
"""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.core.keys import common_prefix_bytes, to_token_array, token_array_and_key

# ids near the values a bool converts to (0 and 1), their low-byte aliases and large ones
token_ids = st.one_of(st.integers(0, 3), st.sampled_from([255, 256, 257, 512, 65536, 65537]),
                      st.integers(0, 2**32 - 1))


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(token_ids, max_size=80), data=st.data())
def test_tokens_convert_exactly_and_any_bool_is_named(tokens: list[int],
                                                       data: st.DataObject) -> None:
    arr, kb = token_array_and_key(tokens, "add_sequence", "r")
    assert arr.tolist() == tokens and kb == array("I", tokens).tobytes()
    assert to_token_array(array("I", tokens), "x", None) == arr
    if not tokens:
        return
    bad = list(tokens)
    i = data.draw(st.integers(0, len(bad) - 1), label="position")
    bad[i] = data.draw(st.booleans(), label="bool")
    first = next(j for j, tok in enumerate(bad) if type(tok) is bool)
    with pytest.raises(ValueError, match=rf"add_sequence\('r'\): token {first} is "
                                         rf"{bad[first]!r}; tokens must be integers, not"):
        token_array_and_key(bad, "add_sequence", "r")


def _naive_common(a: bytes, b: bytes) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(length=st.integers(0, 700), seed=st.integers(0, 2**32 - 1), flip=st.integers(1, 255),
       off=st.integers(0, 9), data=st.data())
def test_common_prefix_bytes_is_the_plain_common_prefix(length: int, seed: int, flip: int,
                                                         off: int, data: st.DataObject) -> None:
    base = random.Random(seed).randbytes(length)
    other = bytearray(base)
    cut = data.draw(st.integers(0, length), label="first difference (length: none)")
    if cut < length:
        other[cut] ^= flip
    key = bytes(other)
    kb = bytes(range(off)) + base  # the prompt's bytes start `off` bytes in
    n = data.draw(st.integers(0, length), label="n")
    assert common_prefix_bytes(kb, off, key, n) == _naive_common(base[:n], key[:n])

"""The tree's keys: token ids as bytes, reuse scopes, and comparing keys.

Tokens are stored as native unsigned 32-bit integers (`array('I')`); converting a list
once is cheap, rejects negative and non-integer tokens for free, and the array's bytes
are the key a tree edge holds. A reuse scope (salt, LoRA id) picks the
tree's root: prompts in different scopes never share blocks.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvcache.core.validate import check_int

TOKEN_BYTES = array("I").itemsize
assert TOKEN_BYTES == 4, "kvcache needs a 4-byte C unsigned int"
_BYTEORDER = sys.byteorder

ScopeKey = Hashable | None


@dataclass(frozen=True)
class ReuseScope:
    """Who may share cached blocks: requests reuse only blocks of their own scope.

    `ReuseScope()` is the default scope, the same as passing `None`; `salt=0` is a
    scope of its own, distinct from `salt=None`. A salt is an int, str or bytes (never a
    bool or float: `True` and `1.0` would silently share `salt=1`'s cache); a LoRA id is
    an int >= 0. Anything else is a ValueError naming the field.
    """

    salt: int | str | bytes | None = None
    lora_id: int | None = None

    def __post_init__(self) -> None:
        if self.salt is not None and not isinstance(self.salt, str | bytes):
            object.__setattr__(self, "salt", check_int(self.salt, "ReuseScope.salt (an int, "
                                                       "str or bytes)"))
        if self.lora_id is not None:
            object.__setattr__(self, "lora_id", check_int(self.lora_id, "ReuseScope.lora_id", 0))

    @property
    def key(self) -> ScopeKey:
        """Hashable key of this scope's tree root (None for the default scope)."""
        if self.salt is None and self.lora_id is None:
            return None
        return (self.salt, self.lora_id)


def scope_key(scope: ReuseScope | None, where: str = "scope") -> ScopeKey:
    """Normalize `scope` to its root key; raises ValueError for anything else."""
    if scope is None:
        return None
    if not isinstance(scope, ReuseScope):
        raise ValueError(f"{where}: expected None or ReuseScope, got {scope!r}")
    return scope.key


def to_token_array(tokens: Sequence[int], op: str, seq_id: Hashable) -> array:
    """Tokens as `array('I')`; raises ValueError naming the call and the first bad token
    (not an integer, a bool, or outside [0, 2**32)), or a value that is not a sequence."""
    return token_array_and_key(tokens, op, seq_id)[0]


def token_array_and_key(tokens: Sequence[int], op: str,
                        seq_id: Hashable) -> tuple[array, bytes]:
    """`to_token_array(tokens, ...)` and its bytes, the tree's key of those tokens (native
    byte order), converted once. Raises as `to_token_array` does."""
    if type(tokens) is array and tokens.typecode == "I":
        copied = array("I", tokens)  # already checked by construction: one memcpy
        return copied, copied.tobytes()
    try:
        items = tokens if type(tokens) is list else list(tokens)
    except TypeError:
        raise ValueError(f"{_where(op, seq_id)}: tokens must be a sequence of integers, "
                         f"got {type(tokens).__name__}") from None
    converted = array("I")
    try:
        converted.fromlist(items)
    except (TypeError, OverflowError):
        for i, tok in enumerate(items):
            if isinstance(tok, bool) or not hasattr(tok, "__index__") or not 0 <= tok < 2**32:
                raise ValueError(f"{_where(op, seq_id)}: token {i} is {tok!r}; tokens must be "
                                 "integers in [0, 2**32)") from None
        raise
    key_bytes = converted.tobytes()
    _reject_bools(key_bytes, items, op, seq_id)
    return converted, key_bytes


_LOW = 0 if _BYTEORDER == "little" else TOKEN_BYTES - 1  # a token's low byte in its 4


def _reject_bools(key_bytes: bytes, items: list[int], op: str, seq_id: Hashable) -> None:
    # array('I') takes True and False as 1 and 0. A type check per item would cost twice
    # the conversion, so type-check only the tokens whose low byte is 0 or 1 (1 in 128 of
    # uniform ids; the single-byte tokens of real vocabularies, frequent in text, are not
    # among them): one strided slice and C-level searches (memchr) find them.
    low = key_bytes[_LOW::TOKEN_BYTES]
    first = len(items)
    for value in (0, 1):
        i = low.find(value)
        while 0 <= i < first:
            if type(items[i]) is bool:
                first = i
                break
            i = low.find(value, i + 1)
    if first < len(items):
        raise ValueError(f"{_where(op, seq_id)}: token {first} is {items[first]!r}; tokens "
                         "must be integers, not bools")


def _where(op: str, seq_id: Hashable) -> str:
    return op if seq_id is None else f"{op}({seq_id!r})"


def common_prefix_bytes(key_bytes: bytes, offset: int, key: bytes, n: int) -> int:
    """Number of equal leading bytes of key_bytes[offset:offset+n] and key[:n] (both at
    least n long).

    C-level comparisons only: one when they are equal; otherwise a binary search over
    zero-copy views down to a 64-byte window, whose first difference one XOR finds. (An
    XOR of the whole range, converting both to ints, costs far more than O(log n)
    compares.)
    """
    view = memoryview(key)
    if key_bytes.startswith(view[:n], offset):
        return n
    # key_bytes[offset:offset+low] == key[:low]; the first difference lies in [low, high)
    low, high = 0, n
    while high - low > 64:
        mid = (low + high) >> 1
        if key_bytes.startswith(view[low:mid], offset + low):
            low = mid
        else:
            high = mid
    differ = (int.from_bytes(key_bytes[offset + low:offset + high], "big")
              ^ int.from_bytes(view[low:high], "big"))
    return high - (differ.bit_length() + 7) // 8

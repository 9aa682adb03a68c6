"""KV-cache events for cache-aware routers: which blocks a cache stores and removes.

A router that sends each request to the replica already holding its prefix needs to know
what every replica caches. The manager (`KvCacheManager(kv_events=True)`) records
`BlockStored` when blocks enter its tree, `BlockRemoved` when they leave it (eviction,
or a claimed partial block) and `AllBlocksCleared` on `reset_cache()`;
`take_kv_events()` hands them over. A block's hash chains its parent's hash, its tokens
and its scope, so equal prefixes hash equal on every replica and in every process:

    hash(block i) = H(hash(block i-1) or ROOT, token bytes of block i, scope)

with H the first 8 bytes of BLAKE2b, read as an unsigned int (no dependence on Python's
randomised `hash`). Field names and meaning follow vLLM's KV events
(`vllm/distributed/kv_events.py`): `block_hashes`, `parent_block_hash`, `token_ids`,
`block_size`, `lora_id`, `medium`. The differences: the salt is its own field (vLLM folds
it into `extra_keys`); a stored partial block (fewer than `block_size` tokens, a leaf
this cache can match partially) is reported like a full one with fewer `token_ids`; and
`medium` is "GPU" for the device pool even when that pool lives in CPU memory (vLLM's
naming; "CPU" is the host tier).
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import IO, Any, Final, Literal

MEDIUM_DEVICE: Final = "GPU"
MEDIUM_HOST: Final = "CPU"
Medium = Literal["GPU", "CPU"]
_ROOT = b"kvcache-harness/root"


def block_hash(parent: int | None, tokens: bytes, scope: Hashable) -> int:
    """The chained hash of one block: `tokens` are its token bytes (uint32, little-endian)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_ROOT if parent is None else parent.to_bytes(8, "little"))
    h.update(tokens)
    h.update(repr(scope).encode())
    return int.from_bytes(h.digest(), "little")


def little_endian_bytes(tokens: Iterable[int]) -> bytes:
    """Token ids as the little-endian uint32 bytes that `block_hash` takes (an `array('I')`
    is read as it is, without a copy, on a little-endian machine)."""
    arr = tokens if type(tokens) is array and tokens.typecode == "I" else array("I", tokens)
    if sys.byteorder != "little":
        arr = array("I", arr)  # a copy: the caller's tokens stay as they were
        arr.byteswap()
    return arr.tobytes()


def chain_hashes(tokens: list[int], block_size: int, scope: Hashable,
                 parent: int | None = None) -> list[int]:
    """Hashes of the full blocks of `tokens` (a partial last block is left out)."""
    out: list[int] = []
    data = little_endian_bytes(tokens)
    step = block_size * 4
    for start in range(0, len(data) - step + 1, step):
        parent = block_hash(parent, data[start:start + step], scope)
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the cache: a chain, each block the parent of the next.

    `token_ids` are the tokens of all of them, in order (the last block may be partial).
    `salt` and `lora_id` are the reuse scope; `medium` the tier holding them.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    salt: int | str | bytes | None
    lora_id: int | None
    medium: Medium = MEDIUM_DEVICE
    type: Literal["BlockStored"] = "BlockStored"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the cache's `medium` (evicted, or taken over by a request)."""

    block_hashes: tuple[int, ...]
    medium: Medium = MEDIUM_DEVICE
    type: Literal["BlockRemoved"] = "BlockRemoved"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block was dropped."""

    type: Literal["AllBlocksCleared"] = "AllBlocksCleared"


KvCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
_TYPES: dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]] = {
    "BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared}


def event_to_dict(event: KvCacheEvent) -> dict[str, Any]:
    """The event as a JSON-friendly dict: tuples become lists, a bytes salt becomes
    {"hex": ...}, and `type` names the kind."""
    out: dict[str, Any] = {}
    for name, value in asdict(event).items():
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, bytes):
            value = {"hex": value.hex()}
        out[name] = value
    return out


def event_from_dict(data: dict[str, Any], where: str = "event") -> KvCacheEvent:
    """Parse one event dict; ValueError naming `where` and the problem otherwise."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    kind = _TYPES.get(data.get("type"))  # type: ignore[arg-type]
    if kind is None:
        raise ValueError(f"{where}: unknown event type {data.get('type')!r}; "
                         f"known: {sorted(_TYPES)}")
    fields: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, dict) and set(value) == {"hex"}:
            try:
                value = bytes.fromhex(value["hex"])
            except (TypeError, ValueError):
                raise ValueError(f"{where}: {name} is not valid hex: "
                                 f"{value['hex']!r}") from None
        fields[name] = value
    try:
        return kind(**fields)
    except TypeError as err:
        raise ValueError(f"{where}: bad {kind.__name__} fields: {err}") from None


def write_jsonl(events: Iterable[KvCacheEvent], out: IO[str]) -> int:
    """Write one JSON object per line; returns how many were written."""
    n = 0
    for event in events:
        out.write(json.dumps(event_to_dict(event), separators=(",", ":")))
        out.write("\n")
        n += 1
    return n


def read_jsonl(lines: Iterable[str], name: str = "<events>") -> Iterator[KvCacheEvent]:
    """Parse JSON lines (blank lines skipped); ValueError naming `name` and the line."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name}:{lineno}: not JSON ({err.msg})") from None
        yield event_from_dict(data, f"{name}:{lineno}")

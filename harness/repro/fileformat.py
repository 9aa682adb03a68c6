"""The repro file's envelope and a validating reader for its fields.

Every repro file is one JSON object:

    {"format": "kvharness-repro", "version": 3, "kind": "reuse" | "scenario", ...}

`kind` says which record follows (harness.repro.reuse_record.ReuseCheckRecord: a reuse
check over a cache's admission log; harness.repro.scenario_record.ScenarioRecord: a scenario's
engines and workload). A reader rejects another format, another version or kind, a missing or
mistyped field and an unknown key with a `ReproFormatError` that names the file and the
field (`engines[0].calls[3].prompts[1]`), so a hand-edited file fails where it is wrong.

A repro file is data someone may have edited, and a re-run is a small engine on this
machine: the reader also bounds what a file can ask for (its size, pool sizes, engines,
calls, events, tokens; the limits below), each limit checked where the field is read, so
no file can make a re-run exhaust memory or run for hours. The JSON is read as every file
the harness reads is (harness.data_files.load_json: nesting bounded, line named). Names of code (models,
backends, engine classes) are checked against harness.repro.registry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, overload

from harness.data_files import load_json

FORMAT = "kvharness-repro"
VERSION = 3
Kind = Literal["reuse", "scenario"]
KINDS: tuple[Kind, ...] = ("reuse", "scenario")
REPRO_DIR = "repro"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")
_NUMBERS = re.compile(r"\[([-+\d\s,.eE]*)\]")  # a JSON array of numbers only
MAX_NAME = 150  # file names stay well under every filesystem's limit

# What a file may ask for. The suites' records are far below every limit (pools of at
# most 2048 tokens, logs of a few hundred events); a tiny-model pool at the limit is 1 GiB.
MAX_FILE_BYTES = 64 << 20
MAX_POOL_BLOCKS = 1 << 16  # max_num_blocks, host_cache_blocks
MAX_POOL_TOKENS = 1 << 18  # a pool's blocks times tokens_per_block
MAX_BATCH = 1 << 10  # max_batch_size, prompts in one call, CUDA-graph batch sizes
MAX_ENGINES = 16
LIMITS = {  # summed over the whole record
    "calls": 1 << 14,
    "events": 1 << 18,  # admission log events
    "tokens": 1 << 20,  # prompt, forced and event tokens
    "new tokens": 1 << 16,  # tokens the calls generate: at most this many decode steps
}
MAX_TOKEN = 1 << 32  # token ids are in [0, 2**32), as kvcache's manager takes them
EVENT_KINDS = ("admit", "commit", "append", "free", "copy", "offload", "onboard")


class ReproFormatError(ValueError):
    """A repro file that cannot be read as a record; the message names file and field."""


class Fields:
    """Typed access to one JSON object of a repro file. Every getter raises
    ReproFormatError naming `file` and the field's path; `close()` rejects keys no getter
    asked for. `spent` is the record's running totals against LIMITS, shared by every
    Fields under the same file's. Reads the data only."""

    def __init__(self, data: Any, file: str, path: str = "",
                 spent: dict[str, int] | None = None) -> None:
        if not isinstance(data, dict):
            raise ReproFormatError(f"{file}: {path or 'the file'} must be a JSON object, "
                                   f"got {type(data).__name__}")
        self.data, self.file, self.path = data, file, path
        self.spent = {} if spent is None else spent
        self._read: set[str] = set()

    def where(self, name: str | int) -> str:
        """The path of field `name` (a key, or an index into this list)."""
        if isinstance(name, int):
            return f"{self.path}[{name}]"
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str, problem: str) -> ReproFormatError:
        """An error about field `name`."""
        return ReproFormatError(f"{self.file}: field {self.where(name)!r} {problem}")

    def get(self, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        """The value of `name`, checked against `kind` (None allowed when `optional`)."""
        self._read.add(name)
        if name not in self.data:
            raise self.error(name, "is missing")
        value = self.data[name]
        if value is None and optional:
            return None
        if (isinstance(value, bool) and bool not in _types(kind)) or not isinstance(value, kind):
            names = " or ".join(t.__name__ for t in _types(kind))
            raise self.error(name, f"must be {names}{' or null' if optional else ''}, "
                             f"got {json.dumps(value)[:60]}")
        return value

    @overload
    def bounded(self, name: str, low: int, high: int) -> int: ...
    @overload
    def bounded(self, name: str, low: int, high: int, *, optional: bool) -> int | None: ...

    def bounded(self, name: str, low: int, high: int, *, optional: bool = False) -> int | None:
        """An int field in [low, high] (None allowed when `optional`)."""
        value: int | None = self.get(name, int, optional=optional)
        if value is not None and not low <= value <= high:
            raise self.error(name, f"is {value}; a re-run allows {low} to {high}")
        return value

    def spend(self, name: str, what: str, amount: int) -> None:
        """Count `amount` of `what` (a LIMITS key) that field `name` asks for; raises
        when the record's total passes the limit. Mutates `spent`."""
        total = self.spent[what] = self.spent.get(what, 0) + amount
        if total > LIMITS[what]:
            raise self.error(name, f"takes the record past {LIMITS[what]} {what} in all, the "
                             "most a re-run takes")

    def choice(self, name: str, choices: tuple[str, ...]) -> str:
        """A string field that must be one of `choices`."""
        value: str = self.get(name, str)
        if value not in choices:
            raise self.error(name, f"is {value!r}; expected one of {', '.join(choices)}")
        return value

    def ints(self, name: str, *, optional: bool = False) -> list[int] | None:
        """A list of ints."""
        values = self.get(name, list, optional=optional)
        if values is not None:
            self._check_ints(values, self.where(name))
        return values

    def int_lists(self, name: str, *, optional: bool = False) -> list[list[int]] | None:
        """A list of lists of ints (prompts, forced tokens)."""
        values = self.get(name, list, optional=optional)
        for i, value in enumerate(values or ()):
            where = f"{self.where(name)}[{i}]"
            if not isinstance(value, list):
                raise ReproFormatError(f"{self.file}: field {where!r} must be a list of ints, "
                                       f"got {json.dumps(value)[:40]}")
            self._check_ints(value, where)
        return values

    def tokens(self, name: str, *, optional: bool = False) -> list[int] | None:
        """A list of token ids in [0, 2**32), counted against the record's tokens."""
        values = self.ints(name, optional=optional)
        self._check_tokens(values or [], self.where(name))
        self.spend(name, "tokens", len(values or ()))
        return values

    def token_lists(self, name: str, *, optional: bool = False) -> list[list[int]] | None:
        """A list of lists of token ids (prompts, forced tokens), counted likewise."""
        values = self.int_lists(name, optional=optional)
        for i, value in enumerate(values or ()):
            self._check_tokens(value, f"{self.where(name)}[{i}]")
        self.spend(name, "tokens", sum(map(len, values or ())))
        return values

    def _check_ints(self, values: list[Any], where: str) -> None:
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ReproFormatError(f"{self.file}: field {where!r} must hold ints; item {i} "
                                       f"is {json.dumps(v)[:40]}")

    def _check_tokens(self, values: list[int], where: str) -> None:
        bad = next((i for i, v in enumerate(values) if not 0 <= v < MAX_TOKEN), None)
        if bad is not None:
            raise ReproFormatError(f"{self.file}: field {where!r} item {bad} is {values[bad]}; "
                                   "token ids are ints in [0, 2**32)")

    def sub(self, name: str) -> Fields:
        """The object under `name`."""
        return Fields(self.get(name, dict), self.file, self.where(name), self.spent)

    def subs(self, name: str, limit: str | None = None) -> Iterator[Fields]:
        """Each object of the list under `name`; with `limit` (a LIMITS key) each counts
        against the record's total of that."""
        base = self.where(name)
        items = self.get(name, list)
        if limit is not None:
            self.spend(name, limit, len(items))
        for i, item in enumerate(items):
            yield Fields(item, self.file, f"{base}[{i}]", self.spent)

    def pools(self, *, required: bool) -> None:
        """Bound the pools a cache config (this object) asks for: tokens_per_block,
        max_num_blocks, host_cache_blocks and each pool's tokens. With `required`,
        tokens_per_block and max_num_blocks must be there; otherwise an absent one is
        left for the replay to report. Its other fields are KvCacheConfig's to check."""
        block = None
        if required or "tokens_per_block" in self.data:
            block = self.bounded("tokens_per_block", 1, MAX_POOL_TOKENS)
        for name in ("max_num_blocks", "host_cache_blocks"):
            if name not in self.data and not (required and name == "max_num_blocks"):
                continue
            blocks = self.bounded(name, 0, MAX_POOL_BLOCKS)
            if block and blocks * block > MAX_POOL_TOKENS:
                raise self.error(name, f"is {blocks} blocks of {block} tokens; a re-run "
                                 f"allows pools of at most {MAX_POOL_TOKENS} tokens")

    def admission_log(self, name: str, *, optional: bool = False) -> list[dict[str, Any]] | None:
        """A cache's admission log (kvcache's CacheEvent.as_dict, one object per event):
        each event's kind, seq_id and the fields its kind needs checked, so that a replay
        never meets a missing or mistyped one; counted against the record's events and
        tokens."""
        if self.get(name, list, optional=optional) is None:
            return None
        events = []
        for event in self.subs(name, "events"):
            _check_event(event)
            events.append(event.data)
        return events

    def close(self) -> None:
        """Raise for a key no getter read (a misspelled field must not pass unseen)."""
        unknown = sorted(set(self.data) - self._read)
        if unknown:
            raise ReproFormatError(f"{self.file}: unknown field(s) "
                                   f"{[self.where(k) for k in unknown]}")


def _types(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


# The fields each kind of event must carry (the others are optional, as in CacheEvent).
_NEEDED = {"admit": ("tokens",), "commit": ("num_tokens",), "append": ("tokens",),
           "free": (), "copy": ("block_ids",), "offload": ("block_ids",),
           "onboard": ("block_ids",)}


def _check_event(f: Fields) -> None:
    """Check one admission-log event: kind, seq_id, the fields its kind needs (an admit
    its prompt, a commit its count, a block move its (src, dst)) and every other field
    it carries; `priority` is accepted beside CacheEvent's fields."""
    kind = f.choice("kind", EVENT_KINDS)
    f.get("seq_id", (int, str))
    carried = set(f.data) | set(_NEEDED[kind])
    if "tokens" in carried and not f.tokens("tokens") and kind == "admit":
        raise f.error("tokens", "is empty; an admitted prompt has at least one token")
    if "num_tokens" in carried:
        f.bounded("num_tokens", 0, LIMITS["tokens"])
    if "scope" in carried:
        _check_scope(f)
    if "block_ids" in carried:
        _check_block_ids(f, kind)
    if "priority" in carried:
        f.bounded("priority", 0, 100)
    f.close()


def _check_scope(f: Fields) -> None:
    scope = f.get("scope", list, optional=True)
    if scope is None:
        return
    salt_ok = len(scope) == 2 and (scope[0] is None or isinstance(scope[0], str) or (
        isinstance(scope[0], int) and not isinstance(scope[0], bool)))
    lora_ok = len(scope) == 2 and (scope[1] is None or (
        isinstance(scope[1], int) and not isinstance(scope[1], bool) and scope[1] >= 0))
    if not (salt_ok and lora_ok):
        raise f.error("scope", f"must be null or [salt, lora_id] (salt null, a str or an "
                      f"int; lora_id null or an int >= 0), got {json.dumps(scope)[:60]}")


def _check_block_ids(f: Fields, kind: str) -> None:
    blocks = f.get("block_ids", list)
    for i, block in enumerate(blocks):
        if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                                  or block < 0):
            raise f.error("block_ids", f"item {i} is {json.dumps(block)[:40]}; block ids are "
                          "ints >= 0 (null: released by a sliding window)")
    if kind in ("copy", "offload", "onboard") and (len(blocks) != 2 or None in blocks):
        raise f.error("block_ids", f"of a {kind} event must be [src, dst], got {blocks}")


def envelope(kind: Kind, body: dict[str, Any]) -> dict[str, Any]:
    """`body` under the format header."""
    return {"format": FORMAT, "version": VERSION, "kind": kind, **body}


def open_file(path: Path) -> tuple[Kind, Fields]:
    """Read `path` and check its header; returns the kind and the body's fields (the
    header already read). Raises ReproFormatError naming the file (and, for JSON nested
    deeper than harness.data_files.MAX_NESTING, the line)."""
    file = str(path)
    if not path.is_file():
        raise ReproFormatError(f"{file}: not a readable repro file: not a regular file")
    data = load_json(path, "repro file", ReproFormatError, MAX_FILE_BYTES)
    fields = Fields(data, file)
    if fields.get("format", str) != FORMAT:
        raise fields.error("format", f"is {data['format']!r}, not {FORMAT!r}")
    version = fields.get("version", int)
    if version != VERSION:
        raise fields.error("version", f"is {version}; this kvharness reads version {VERSION} "
                           "(rerun the test to write a current file)")
    kind: Kind = fields.choice("kind", KINDS)  # type: ignore[assignment]
    return kind, fields


def write_file(results_dir: Path, node_id: str, data: dict[str, Any]) -> Path:
    """Write `<results_dir>/repro/<test id>.json` (the id made file-safe); returns it."""
    name = _UNSAFE.sub("_", node_id).strip("_")[:MAX_NAME] or "test"
    path = results_dir / REPRO_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Indented for reading, but a prompt or a token list stays on one line.
    text = _NUMBERS.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]",
                        json.dumps(data, indent=1))
    path.write_text(text, encoding="utf-8")
    return path

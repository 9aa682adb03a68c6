"""Operations on a `CacheUnderTest` as data: what the checks, the fuzzer and a replay send.

An op list is plain JSON (`ops_to_json` / `ops_from_json`), so a failure's shrunk op list
in report.json replays anywhere (`kvharness conform SPEC --replay FILE`), and the worker
inside an engine's venv receives nothing but data. Standard library only.

    admit   seq, tokens, scope, first_chunk   -> Admission | refused
    reserve seq, num_tokens                   -> tokens scheduled | refused
    commit  seq, num_tokens
    append  seq, tokens                       -> block ids | refused
    free    seq
    evict   num_blocks                        -> blocks evicted
    preempt seq                               (the engine's own preemption path)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from harness.conform.known_keys import check_keys
from harness.conform.protocol import Scope

OpKind = Literal["admit", "reserve", "commit", "append", "free", "evict", "preempt"]
KINDS: tuple[OpKind, ...] = get_args(OpKind)
# the fields each kind takes besides `kind`
_FIELDS: dict[str, tuple[str, ...]] = {
    "admit": ("seq", "tokens", "scope", "first_chunk"), "reserve": ("seq", "num_tokens"),
    "commit": ("seq", "num_tokens"), "append": ("seq", "tokens"), "free": ("seq",),
    "evict": ("num_blocks",), "preempt": ("seq",)}
MAX_TOKEN = 2**31 - 1  # every engine here takes token ids as int32 or wider


def _count(value: Any, where: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where} must be an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class Op:
    """One operation. Construct with the module's functions (`admit`, `commit`, ...) or
    `Op.from_dict`; ValueError names the bad field."""

    kind: OpKind
    seq: str | None = None
    tokens: tuple[int, ...] = ()
    scope: Scope | None = None
    first_chunk: int | None = None
    num_tokens: int | None = None
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"op kind must be one of {KINDS}, got {self.kind!r}")
        where = f"{self.kind} op"
        wanted = _FIELDS[self.kind]
        for name in ("seq", "tokens", "scope", "first_chunk", "num_tokens", "num_blocks"):
            value = getattr(self, name)
            if name not in wanted and value not in (None, ()):
                raise ValueError(f"{where}: takes no {name} (it takes {', '.join(wanted)})")
        if "seq" in wanted and (not isinstance(self.seq, str) or not self.seq):
            raise ValueError(f"{where}: seq must be a non-empty str, got {self.seq!r}")
        if "tokens" in wanted:
            if not self.tokens:
                raise ValueError(f"{where} for {self.seq!r}: no tokens")
            for t in self.tokens:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN:
                    raise ValueError(f"{where} for {self.seq!r}: token {t!r} is not an int "
                                     f"in [0, {MAX_TOKEN}]")
        if self.scope is not None and not isinstance(self.scope, Scope):
            raise ValueError(f"{where}: scope must be a Scope or None, got {self.scope!r}")
        if self.first_chunk is not None:
            _count(self.first_chunk, f"{where}: first_chunk", 1)
        if "num_tokens" in wanted:
            _count(self.num_tokens, f"{where} for {self.seq!r}: num_tokens", 0)
        if "num_blocks" in wanted:
            _count(self.num_blocks, f"{where}: num_blocks", 0)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: kind and the fields it takes (unset optional ones left out)."""
        out: dict[str, Any] = {"kind": self.kind}
        for name in _FIELDS[self.kind]:
            value = getattr(self, name)
            if name == "tokens":
                value = list(value)
            elif name == "scope":
                value = None if value is None else value.as_dict()
            if value is not None:
                out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "op") -> Op:
        """Parse `as_dict`'s output; ValueError naming `where` and the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        kind = data.get("kind")
        if kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {KINDS}, got {kind!r}")
        check_keys(data, ("kind", *_FIELDS[kind]), f"{where}: a {kind} op")
        values = {k: v for k, v in data.items() if k != "kind"}
        if "tokens" in values:
            if not isinstance(values["tokens"], list):
                raise ValueError(f"{where}: tokens must be a list of ints")
            values["tokens"] = tuple(values["tokens"])
        if "scope" in values:
            values["scope"] = Scope.from_dict(values["scope"], f"{where}: scope")
        try:
            return cls(kind, **values)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def describe(self) -> str:
        """One line holding the whole op (every token):
        `admit(A, 18 tokens 100..117, salt='x', first_chunk=8)`."""
        args: list[str] = [] if self.seq is None else [self.seq]
        if self.tokens:
            args.append(_tokens(self.tokens))
        if self.scope is not None:
            args.append(self.scope.describe())
        if self.first_chunk is not None:
            args.append(f"first_chunk={self.first_chunk}")
        for value in (self.num_tokens, self.num_blocks):
            if value is not None:
                args.append(str(value))
        return f"{self.kind}({', '.join(args)})"


def _tokens(tokens: Sequence[int]) -> str:
    """Every token, runs of three or more consecutive ids written `first..last`: the text
    is the op list itself (report.md's op lists reproduce a failure without report.json)."""
    if len(tokens) <= 4:
        return f"tokens {list(tokens)}"
    parts: list[str] = []
    start = 0
    for i in range(1, len(tokens) + 1):
        if i < len(tokens) and tokens[i] == tokens[i - 1] + 1:
            continue
        run = tokens[start:i]
        parts += [f"{run[0]}..{run[-1]}"] if len(run) >= 3 else [str(t) for t in run]
        start = i
    body = parts[0] if len(parts) == 1 and ".." in parts[0] else f"[{', '.join(parts)}]"
    return f"{len(tokens)} tokens {body}"


def admit(seq: str, tokens: Iterable[int], scope: Scope | None = None,
          first_chunk: int | None = None) -> Op:
    """An admit op."""
    return Op("admit", seq, tuple(tokens), scope, first_chunk)


def reserve(seq: str, num_tokens: int) -> Op:
    """A reserve op (schedule tokens up to `num_tokens`)."""
    return Op("reserve", seq, num_tokens=num_tokens)


def commit(seq: str, num_tokens: int) -> Op:
    """A commit op (tokens [0, num_tokens) computed)."""
    return Op("commit", seq, num_tokens=num_tokens)


def append(seq: str, tokens: Iterable[int]) -> Op:
    """An append op (decode tokens)."""
    return Op("append", seq, tuple(tokens))


def free(seq: str) -> Op:
    """A free op."""
    return Op("free", seq)


def evict(num_blocks: int) -> Op:
    """An evict op."""
    return Op("evict", num_blocks=num_blocks)


def preempt(seq: str) -> Op:
    """A preempt op (the engine preempts the live sequence; it resumes by an admit of
    its id with its prompt and the tokens appended since)."""
    return Op("preempt", seq)


def ops_to_json(ops: Iterable[Op]) -> list[dict[str, Any]]:
    """An op list as JSON-ready dicts."""
    return [op.as_dict() for op in ops]


def ops_from_json(data: Any, where: str = "ops") -> list[Op]:
    """Parse an op list; ValueError naming `where[i]` and the field."""
    if not isinstance(data, list):
        raise ValueError(f"{where}: expected a list of ops, got {type(data).__name__}")
    return [Op.from_dict(d, f"{where}[{i}]") for i, d in enumerate(data)]

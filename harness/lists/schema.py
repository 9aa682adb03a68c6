"""The test-db file format: safe YAML with line numbers, pydantic models, entry grammar.

A list file is `version` plus one context named after the file (`l0_h100.yml` holds
`l0_h100`), a list of blocks `{condition: {ranges, wildcards, terms}, tests: [...]}`.
test_lists/SCHEMA.md is the reference for users; this module is the executable form.
Everything here raises `ListError` whose problems name file and line.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    create_model,
    model_validator,
)

from harness.hardware import Backend, Stage
from harness.lists.errors import ListError, Location, Problem

Version = Literal["0.0.1"]
SUPPORTED_VERSIONS: tuple[str, ...] = get_args(Version)
DEFAULT_TIMEOUT_SECONDS = 60 * 60
CONTEXT_NAME = re.compile(r"l\d+_[a-z0-9_]+")
_OPTION = re.compile(r"\s+(?:TIMEOUT\s*\(\s*(?P<minutes>[^()]*?)\s*\)|(?P<isolation>ISOLATION))")


class EntrySpec(NamedTuple):
    """What an entry says, wherever it came from: node id, timeout (None: default), isolation."""

    test: str
    timeout_seconds: int | None
    isolation: bool


def check_node_id(node_id: str) -> str:
    """Return `node_id` if it is a repository-relative pytest node id or path prefix.

    Raises ValueError naming the node id and what is wrong with it.
    """
    path, _, rest = node_id.partition("::")
    if not path:
        raise ValueError(f"node id {node_id!r} has no path")
    if path.startswith("/") or "\\" in path:
        raise ValueError(f"node id {node_id!r}: paths are relative to the repository root, with /")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"node id {node_id!r}: path {path!r} has an empty, '.' or '..' part")
    if rest and not path.endswith(".py"):
        raise ValueError(f"node id {node_id!r}: '::' may only follow a .py file")
    if "::" in node_id and any(not part for part in rest.split("::")):
        raise ValueError(f"node id {node_id!r} has an empty '::' part")
    return node_id


def _split_node_id(text: str) -> tuple[str, str]:
    # Parametrized ids may hold spaces inside [...]; the node id ends at the first
    # whitespace outside brackets.
    depth = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif ch.isspace() and depth == 0:
            return text[:i], text[i:]
    return text, ""


def parse_entry_text(text: str) -> EntrySpec:
    """Parse `node_id [TIMEOUT (minutes)] [ISOLATION]`; raises ValueError naming the entry."""
    node_id, rest = _split_node_id(text.strip())
    check_node_id(node_id)
    minutes: int | None = None
    isolation = False
    pos = 0
    while rest[pos:].strip():
        match = _OPTION.match(rest, pos)
        if match is None:
            raise ValueError(
                f"entry {text!r}: unexpected {rest[pos:].strip()!r} after the node id; "
                "an entry is 'node_id [TIMEOUT (minutes)] [ISOLATION]'"
            )
        pos = match.end()
        if match["isolation"]:
            if isolation:
                raise ValueError(f"entry {text!r}: ISOLATION given twice")
            isolation = True
            continue
        if minutes is not None:
            raise ValueError(f"entry {text!r}: TIMEOUT given twice")
        if not match["minutes"].isdigit() or int(match["minutes"]) == 0:
            raise ValueError(f"entry {text!r}: TIMEOUT ({match['minutes']}) is not a positive "
                             "whole number of minutes")
        minutes = int(match["minutes"])
        if minutes * 60 == DEFAULT_TIMEOUT_SECONDS:
            raise ValueError(f"entry {text!r}: TIMEOUT ({minutes}) is the default; remove it")
    return EntrySpec(node_id, None if minutes is None else minutes * 60, isolation)


class UnknownKeyError(ValueError):
    """A mapping holds a key its model does not declare; `key` extends the error's path."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @classmethod
    def _unknown_key(cls, key: str) -> str:
        return f"unknown key {key!r}; allowed: {', '.join(cls.model_fields)}"

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    raise UnknownKeyError(str(key), cls._unknown_key(str(key)))
        return data


def _wrap_scalar(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


NonNegative = Annotated[int, Field(ge=0)]
Globs = Annotated[
    list[Annotated[str, Field(min_length=1)]], BeforeValidator(_wrap_scalar), Field(min_length=1)
]


class RangeModel(_Strict):
    gte: NonNegative | None = None
    lte: NonNegative | None = None

    @model_validator(mode="after")
    def _bounds(self) -> RangeModel:
        if self.gte is None and self.lte is None:
            raise ValueError("a range needs gte, lte or both")
        if self.gte is not None and self.lte is not None and self.gte > self.lte:
            raise ValueError(f"empty range: gte {self.gte} > lte {self.lte}")
        return self


class RangesModel(_Strict):
    system_gpu_count: RangeModel


class WildcardsModel(_Strict):
    gpu: Globs | None = None
    cpu: Globs | None = None

    @model_validator(mode="after")
    def _some(self) -> WildcardsModel:
        if self.gpu is None and self.cpu is None:
            raise ValueError("wildcards needs gpu, cpu or both")
        return self


class TermsModel(_Strict):
    stage: Stage
    backend: Backend | None = None


class ConditionModel(_Strict):
    ranges: RangesModel | None = None
    wildcards: WildcardsModel | None = None
    terms: TermsModel


class EntryMapping(_Strict):
    test: Annotated[str, AfterValidator(check_node_id)]
    timeout_seconds: Annotated[int, Field(gt=0)] | None = None
    isolation: bool = False

    @model_validator(mode="after")
    def _not_default(self) -> EntryMapping:
        if self.timeout_seconds == DEFAULT_TIMEOUT_SECONDS:
            raise ValueError(f"timeout_seconds {self.timeout_seconds} is the default; remove it")
        return self

    def spec(self) -> EntrySpec:
        return EntrySpec(self.test, self.timeout_seconds, self.isolation)


def _check_entry_text(text: str) -> str:
    parse_entry_text(text)
    return text


def _entry_kind(value: Any) -> str | None:
    return "<text>" if isinstance(value, str) else "<mapping>" if isinstance(value, dict) else None


# Tags start with "<" so error paths can drop them (they are not YAML keys).
EntryField = Annotated[
    Annotated[Annotated[str, AfterValidator(_check_entry_text)], Tag("<text>")]
    | Annotated[EntryMapping, Tag("<mapping>")],
    Discriminator(
        _entry_kind,
        custom_error_type="entry_type",
        custom_error_message="an entry is a node id string or a mapping "
        "{test, timeout_seconds, isolation}",
    ),
]


class BlockModel(_Strict):
    condition: ConditionModel
    tests: Annotated[list[EntryField], Field(min_length=1)]


class _FileBase(_Strict):
    @classmethod
    def _unknown_key(cls, key: str) -> str:
        context = next(name for name in cls.model_fields if name != "version")
        return (f"unknown top-level key {key!r}: a list file holds 'version' and one context "
                f"named after the file ({context!r})")


class ListFileDoc(NamedTuple):
    """A validated list file: its context name, its blocks, and the YAML node tree for lines."""

    path: Path
    context: str
    blocks: tuple[BlockModel, ...]
    root: yaml.Node

    def line(self, *loc: str | int) -> int:
        """1-based line of the value at `loc` (keys and indices from the file's top)."""
        return node_line(self.root, loc)


class ListLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Hashable, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeConstructor reports unhashable keys itself, with the line.
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def node_line(root: yaml.Node, loc: tuple[str | int, ...]) -> int:
    """Line of the deepest node along `loc` that exists (a missing key: its parent's line)."""
    node, line = root, root.start_mark.line + 1
    for key in loc:
        child: tuple[yaml.Node, yaml.Node] | None = None
        if isinstance(node, yaml.MappingNode) and isinstance(key, str):
            child = next(((k, v) for k, v in node.value if k.value == key), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            child = (node.value[key], node.value[key])
        if child is None:
            break
        line, node = child[0].start_mark.line + 1, child[1]
    return line


def load_yaml(path: Path) -> tuple[Any, yaml.Node | None]:
    """Safely load one YAML document and its node tree; raises ListError on YAML errors."""
    loader = ListLoader(path.read_text(encoding="utf-8"))
    try:
        root = loader.get_single_node()
        return (None if root is None else loader.construct_document(root)), root
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = None if mark is None else mark.line + 1
        raise ListError([Problem(Location(path, line), f"YAML: {exc.problem}")]) from None
    except yaml.YAMLError as exc:
        raise ListError([Problem(Location(path, None), f"YAML: {exc}")]) from None
    finally:
        loader.dispose()


def _path_text(loc: tuple[str | int, ...]) -> str:
    out = ""
    for key in loc:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def _messages(path: Path, root: yaml.Node, exc: ValidationError) -> Iterator[Problem]:
    for err in exc.errors():
        loc = tuple(k for k in err["loc"] if not (isinstance(k, str) and k.startswith("<")))
        error = (err.get("ctx") or {}).get("error")
        # The path names the mapping that holds an unknown or missing key; the line is
        # the unknown key's own (a missing key has none: node_line stops at the mapping).
        where = _path_text(loc[:-1] if err["type"] == "missing" else loc)
        if isinstance(error, UnknownKeyError):
            loc += (error.key,)
        if isinstance(error, ValueError):
            message = str(error)
        elif err["type"] == "missing":
            message = f"missing key {loc[-1]!r}"
        else:
            message = f"{err['msg']} (got {err['input']!r})"
        yield Problem(Location(path, node_line(root, loc)), f"{where}: {message}" if where else message)


def read_list_file(path: Path) -> ListFileDoc:
    """Load and validate one list file; raises ListError with every problem found."""
    context = path.stem
    if CONTEXT_NAME.fullmatch(context) is None:
        raise ListError([Problem(Location(path, None), f"file name {path.name!r}: a list file is "
                                 "named after its context, e.g. l0_h100.yml")])
    data, root = load_yaml(path)
    if root is None or not isinstance(data, dict):
        line = None if root is None else root.start_mark.line + 1
        raise ListError([Problem(Location(path, line), "a list file is a mapping of 'version' and "
                                 f"the context {context!r}")])
    fields: dict[str, Any] = {
        "version": (Version, ...),
        context: (Annotated[list[BlockModel], Field(min_length=1)], ...),
    }
    model = create_model(f"ListFile_{context}", __base__=_FileBase, **fields)
    try:
        doc = model.model_validate(data)
    except ValidationError as exc:
        raise ListError(_messages(path, root, exc)) from None
    return ListFileDoc(path, context, tuple(getattr(doc, context)), root)

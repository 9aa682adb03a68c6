"""The test-db file format: safe YAML with line numbers, pydantic models, and the entries
they hold (parsed by harness.lists.entry).

A list file is `version` plus one context named after the file (`l0_h100.yml` holds
`l0_h100`), a list of blocks `{condition: {ranges, wildcards, terms}, tests: [...]}`.
test_lists/SCHEMA.md is the reference for users; this module is the executable form.
Everything here raises `ListError` whose problems name file and line.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterator
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    create_model,
    model_validator,
)

from harness.data_files import MAX_NESTING, too_deep
from harness.lists.entry import BlockPolicy, Entry, parse_entry_mapping, parse_entry_text
from harness.lists.errors import KeyProblem, KeyProblems, ListError, Location, Problem
from harness.lists.files import read_list_text
from harness.lists.gpus import FEATURES
from harness.lists.hardware import BACKENDS, ORCHESTRATORS, STAGES

Version = Literal["0.0.1"]
SUPPORTED_VERSIONS: tuple[str, ...] = get_args(Version)
CONTEXT_NAME = re.compile(r"l[0-9]+_[a-z0-9_]+")  # ASCII digits: \d reads every script's
# YAML integers longer than this are refused before Python parses them (past ~4300
# digits int() raises; long before that they are nonsense in a list).
MAX_INT_DIGITS = 18


class _Strict(BaseModel):
    # Unknown keys are pydantic's `extra_forbidden` errors, reported beside every other
    # error of the same mapping (`_messages` names the allowed keys).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


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


# The one term this harness interprets itself: the attention backend a block needs
# (`attention_backend: flashinfer`). `backend` is TensorRT-LLM's job term (its runtime:
# pytorch, cpp, tensorrt, triton, fmha, ...), matched like any other term.
ATTENTION_BACKEND = "attention_backend"
# Terms whose values this harness knows; every other term is any one scalar.
KNOWN_TERMS: dict[str, tuple[Any, ...]] = {
    "stage": STAGES, "orchestrator": ORCHESTRATORS, ATTENTION_BACKEND: BACKENDS,
    **{name: (True, False) for name in FEATURES},
}


def _allowed(values: tuple[Any, ...]) -> str:
    return ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values)


def _term_problem(key: str, value: Any) -> str | None:
    """Why `terms.<key>: value` is wrong, or None."""
    if value is None or isinstance(value, list | dict):
        return f"a term is one string, number or boolean (got {value!r})"
    known = KNOWN_TERMS.get(key)
    if known is not None and (value not in known or isinstance(value, bool) != isinstance(
            known[0], bool)):
        return f"{value!r} is not one of {_allowed(known)}"
    if key == "backend" and value in BACKENDS:
        return (f"{value!r} is an attention backend; 'backend' is the job's (TensorRT-LLM's "
                f"runtime: pytorch, cpp, tensorrt, triton, fmha, ...): write "
                f"'{ATTENTION_BACKEND}: {value}'")
    if isinstance(value, str) and not value:
        return "a term is not empty"
    return None


def _terms(data: Any) -> Any:
    """Check every term of a `terms` mapping at once; raises KeyProblems naming each bad
    one (the mapping itself is checked by pydantic)."""
    if not isinstance(data, dict):
        return data
    problems = [KeyProblem(str(key), why, in_path=True) for key, value in data.items()
                if (why := _term_problem(str(key), value)) is not None]
    if problems:
        raise KeyProblems(problems)
    return data


Terms = Annotated[dict[str, Any], BeforeValidator(_terms), Field(min_length=1)]


class ConditionModel(_Strict):
    """Any key in each section: the ones this harness interprets (KNOWN_TERMS) are
    checked for their values; the others are matched against the job's description."""

    ranges: Annotated[dict[str, RangeModel], Field(min_length=1)] | None = None
    wildcards: Annotated[dict[str, Globs], Field(min_length=1)] | None = None
    terms: Terms | None = None


def _entry(value: Any) -> Entry:
    """The entry a list item says: a text or a mapping (harness.lists.entry), not yet
    placed in its file. Raises ValueError (KeyProblem for a mapping's key) naming it."""
    if isinstance(value, str):
        return parse_entry_text(value)
    if isinstance(value, dict):
        return parse_entry_mapping(value)
    raise ValueError("an entry is a node id string or a mapping {test, timeout_seconds, "
                     f"isolation, keyword}} (got {value!r})")


EntryField = Annotated[Entry, PlainValidator(_entry)]


class BlockModel(_Strict):
    condition: ConditionModel
    tests: Annotated[list[EntryField], Field(min_length=1)]  # parsed, placed by the reader
    reruns: bool | None = None  # None: rerun failures in post_merge blocks only
    always_run: bool = False  # run even when --kvh-changed-since finds nothing it depends on
    source_file_dependencies: Globs | None = None  # changes that must run this block

    def policy(self) -> BlockPolicy:
        """What the block says about its tests beyond selecting them."""
        stage = (self.condition.terms or {}).get("stage")
        reruns = stage == "post_merge" if self.reruns is None else self.reruns
        return BlockPolicy(reruns, self.always_run, tuple(self.source_file_dependencies or ()))


class ListFileDoc(NamedTuple):
    """A validated list file: its context name, its blocks, and the YAML node tree for lines."""

    path: Path
    context: str
    blocks: tuple[BlockModel, ...]
    root: yaml.Node

    def line(self, *loc: str | int) -> int:
        """1-based line of the value at `loc` (keys and indices from the file's top)."""
        return node_line(self.root, loc)


class _ConstructChecks(yaml.constructor.SafeConstructor):
    """The construction checks of every list loader: duplicate keys, bounded integers."""

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

    def construct_bounded_int(self, node: yaml.ScalarNode) -> int:
        digits = sum(ch.isdigit() for ch in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer of {digits} digits; list numbers have at most "
                f"{MAX_INT_DIGITS}", node.start_mark)
        value: int = super().construct_yaml_int(node)
        return value


class ListLoader(_ConstructChecks, yaml.SafeLoader):
    """SafeLoader for lists: rejects duplicate mapping keys (PyYAML keeps the last one
    silently), aliases (`*name`: nested ones expand exponentially, a YAML bomb),
    sequences and mappings nested deeper than MAX_NESTING (the composer recurses a level
    at a time), and integers too long to be anything but a mistake."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0  # sequences and mappings open around the node being composed

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*{event.anchor}) are not allowed in list files; write "
                "the value out", event.start_mark)
        opens = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        if opens and self.depth == MAX_NESTING:
            raise yaml.composer.ComposerError(
                None, None, too_deep("sequences and mappings"), self.peek_event().start_mark)
        self.depth += opens
        try:
            node: yaml.Node | None = super().compose_node(parent, index)
        finally:
            self.depth -= opens
        assert node is not None, "compose_node returns None only at the end of the stream"
        return node


def _bounded_int(loader: Any, node: yaml.ScalarNode) -> int:
    value: int = loader.construct_bounded_int(node)
    return value


ListLoader.add_constructor("tag:yaml.org,2002:int", _bounded_int)

_CListLoader: type | None = None
if getattr(yaml, "__with_libyaml__", False):
    class _CLoader(_ConstructChecks, yaml.CSafeLoader):
        """libyaml's parser and composer with ListLoader's construction checks."""

    _CLoader.add_constructor("tag:yaml.org,2002:int", _bounded_int)
    _CListLoader = _CLoader


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


def _check_events(text: str) -> None:
    """ListLoader's refusals (aliases, nesting deeper than MAX_NESTING) over libyaml's
    event stream, before libyaml composes anything. Raises yaml.MarkedYAMLError."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*{event.anchor}) are not allowed in list files; write "
                "the value out", event.start_mark)  # type: ignore[arg-type]
        if isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            depth += 1
            if depth > MAX_NESTING:
                raise yaml.composer.ComposerError(
                    None, None, too_deep("sequences and mappings"),
                    event.start_mark)  # type: ignore[arg-type]
        elif isinstance(event, yaml.SequenceEndEvent | yaml.MappingEndEvent):
            depth -= 1


def _compose(text: str) -> tuple[Any, yaml.Node | None]:
    """The document and its node tree: with libyaml (ten times faster, for pre-commit
    runs) after `_check_events`, else with ListLoader; both construct through
    ListLoader's duplicate-key and integer checks."""
    loader: Any
    if _CListLoader is not None:
        _check_events(text)
        loader = _CListLoader(text)
    else:
        loader = ListLoader(text)
    try:
        root = loader.get_single_node()
        return (None if root is None else loader.construct_document(root)), root
    finally:
        loader.dispose()


def load_yaml(path: Path) -> tuple[Any, yaml.Node | None]:
    """Safely load one YAML document and its node tree; raises ListError on YAML errors
    and on files `read_list_text` refuses."""
    text = read_list_text(path, "list file")
    try:
        return _compose(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = None if mark is None else mark.line + 1
        raise ListError([Problem(Location(path, line), f"YAML: {exc.problem}")]) from None
    except yaml.YAMLError as exc:
        raise ListError([Problem(Location(path, None), f"YAML: {exc}")]) from None


def _path_text(loc: tuple[str | int, ...]) -> str:
    out = ""
    for key in loc:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def _key_problem(path: Path, root: yaml.Node, loc: tuple[str | int, ...],
                 error: KeyProblem) -> Problem:
    """A problem at one key of the mapping at `loc`: the key's line; the path names the
    mapping (an unknown key) or the key (a bad value)."""
    where = _path_text((*loc, error.key) if error.in_path else loc)
    return Problem(Location(path, node_line(root, (*loc, error.key))), f"{where}: {error}")


def _unwrap(kind: Any) -> Any:
    """`kind` without Annotated metadata and without None in a union."""
    while True:
        origin = get_origin(kind)
        if origin is Annotated:
            kind = get_args(kind)[0]
        elif origin in (Union, UnionType):
            kind = next(a for a in get_args(kind) if a is not type(None))
        else:
            return kind


def _fields_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> tuple[str, ...]:
    """The keys the model at `loc` (a mapping's place in a list file) allows."""
    kind: Any = model
    for key in loc:
        kind = _unwrap(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            kind = kind.model_fields[str(key)].annotation
        else:  # a list's item or a dict's value
            kind = get_args(kind)[-1]
    kind = _unwrap(kind)
    return tuple(kind.model_fields) if isinstance(kind, type) and issubclass(kind, BaseModel) else ()


def _unknown_key(path: Path, model: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    key = loc[-1]
    if len(loc) == 1:
        return (f"unknown top-level key {key!r}: a list file holds 'version' and one context "
                f"named after the file ({path.stem!r})")
    return f"unknown key {key!r}; allowed: {', '.join(_fields_at(model, loc[:-1]))}"


def _messages(path: Path, root: yaml.Node, exc: ValidationError,
              model: type[BaseModel]) -> Iterator[Problem]:
    for err in exc.errors():
        loc = tuple(err["loc"])
        error = (err.get("ctx") or {}).get("error")
        if isinstance(error, KeyProblem | KeyProblems):
            yield from (_key_problem(path, root, loc, e) for e in
                        (error.problems if isinstance(error, KeyProblems) else (error,)))
            continue
        # The path names the mapping that holds a missing or unknown key (the line is the
        # key's, or for a missing one the mapping's).
        where = _path_text(loc[:-1] if err["type"] in ("missing", "extra_forbidden") else loc)
        if err["type"] == "extra_forbidden":
            message = _unknown_key(path, model, loc)
        elif isinstance(error, ValueError):
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
                                 "named after its context: 'l', a level in ASCII digits, '_', "
                                 "the machine kind in [a-z0-9_], e.g. l0_h100.yml")])
    data, root = load_yaml(path)
    if root is None or not isinstance(data, dict):
        line = None if root is None else root.start_mark.line + 1
        raise ListError([Problem(Location(path, line), "a list file is a mapping of 'version' and "
                                 f"the context {context!r}")])
    fields: dict[str, Any] = {
        "version": (Version, ...),
        context: (Annotated[list[BlockModel], Field(min_length=1)], ...),
    }
    model = create_model(f"ListFile_{context}", __base__=_Strict, **fields)
    try:
        doc = model.model_validate(data)
    except ValidationError as exc:
        raise ListError(_messages(path, root, exc, model)) from None
    return ListFileDoc(path, context, tuple(getattr(doc, context)), root)

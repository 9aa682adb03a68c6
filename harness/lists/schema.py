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
from typing import Annotated, Any, Literal, NamedTuple, get_args

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
from harness.lists.hardware import Backend, Orchestrator, Stage

Version = Literal["0.0.1"]
SUPPORTED_VERSIONS: tuple[str, ...] = get_args(Version)
CONTEXT_NAME = re.compile(r"l[0-9]+_[a-z0-9_]+")  # ASCII digits: \d reads every script's
# YAML integers longer than this are refused before Python parses them (past ~4300
# digits int() raises; long before that they are nonsense in a list).
MAX_INT_DIGITS = 18


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
                    raise KeyProblem(str(key), cls._unknown_key(str(key)), in_path=False)
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
    linux_distribution_name: Globs | None = None
    compute_capability: Globs | None = None

    @model_validator(mode="after")
    def _some(self) -> WildcardsModel:
        if all(getattr(self, key) is None for key in type(self).model_fields):
            raise ValueError(f"wildcards needs one of {', '.join(type(self).model_fields)}")
        return self


# TensorRT-LLM's backend names onto this project's: its PyTorch flow is the torch
# backend here; `generic` (stages bound to no backend) places no condition.
TRTLLM_BACKENDS: dict[str, Backend | None] = {"pytorch": "torch", "generic": None}
_NO_COUNTERPART = ("tensorrt", "cpp", "triton")


def _backend_name(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if value in _NO_COUNTERPART:
        raise ValueError(f"backend {value!r} is TensorRT-LLM's and has no counterpart here; "
                         "use torch, flashinfer, pytorch (= torch) or generic (any backend)")
    return TRTLLM_BACKENDS.get(value, value)


class TermsModel(_Strict):
    stage: Stage
    backend: Annotated[Backend | None, BeforeValidator(_backend_name)] = None
    orchestrator: Orchestrator | None = None
    supports_int8: bool | None = None
    supports_tf32: bool | None = None
    supports_bf16: bool | None = None
    supports_fp8: bool | None = None
    supports_fp4: bool | None = None

    def features(self) -> dict[str, bool]:
        """The supports_* terms the block states."""
        return {name: value for name in FEATURES
                if (value := getattr(self, name)) is not None}


class ConditionModel(_Strict):
    ranges: RangesModel | None = None
    wildcards: WildcardsModel | None = None
    terms: TermsModel


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
        reruns = self.condition.terms.stage == "post_merge" if self.reruns is None else self.reruns
        return BlockPolicy(reruns, self.always_run, tuple(self.source_file_dependencies or ()))


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


ListLoader.add_constructor("tag:yaml.org,2002:int", ListLoader.construct_bounded_int)


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
    """Safely load one YAML document and its node tree; raises ListError on YAML errors
    and on files `read_list_text` refuses."""
    loader = ListLoader(read_list_text(path, "list file"))
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


def _key_problem(path: Path, root: yaml.Node, loc: tuple[str | int, ...],
                 error: KeyProblem) -> Problem:
    """A problem at one key of the mapping at `loc`: the key's line; the path names the
    mapping (an unknown key) or the key (a bad value)."""
    where = _path_text((*loc, error.key) if error.in_path else loc)
    return Problem(Location(path, node_line(root, (*loc, error.key))), f"{where}: {error}")


def _messages(path: Path, root: yaml.Node, exc: ValidationError) -> Iterator[Problem]:
    for err in exc.errors():
        loc = tuple(err["loc"])
        error = (err.get("ctx") or {}).get("error")
        if isinstance(error, KeyProblem | KeyProblems):
            yield from (_key_problem(path, root, loc, e) for e in
                        (error.problems if isinstance(error, KeyProblems) else (error,)))
            continue
        # The path names the mapping that holds a missing key (the line is the mapping's:
        # a missing key has none).
        where = _path_text(loc[:-1] if err["type"] == "missing" else loc)
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
    model = create_model(f"ListFile_{context}", __base__=_FileBase, **fields)
    try:
        doc = model.model_validate(data)
    except ValidationError as exc:
        raise ListError(_messages(path, root, exc)) from None
    return ListFileDoc(path, context, tuple(getattr(doc, context)), root)

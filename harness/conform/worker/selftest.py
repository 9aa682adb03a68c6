"""The self-test run before any check: the code under test is the engine's own, unmocked.

An adapter names every engine callable it calls (`engine_callables()`: name -> (owner,
attribute), read afresh each time), which of them each op kind calls (`engine_calls()`:
what a report names as the engine code a failing op went through), and returns the
engine's raw results of one probe admission (`raw_probe()`). The self-test proves that

- each callable is a plain Python function (a method's function) whose source file lies
  inside the installed engine package: not a stub, not a `unittest.mock` object, not a
  function defined anywhere else (a test's lambda, a patched-in replacement);
- no engine module on the cache's path is a stub;
- no raw result holds a mock or a stub, however deep (a mocked call returns mocks);
- and that the test itself bites: each callable in turn is shadowed by a MagicMock, a
  raising stub and a foreign function, and each substitute must be refused.

Standard library only: it runs inside the engine's worker.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import unittest.mock
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from harness.conform.ops import KINDS
from harness.conform.protocol import LoadedEngine
from harness.conform.stubs import is_stub, raising_function

Callables = Mapping[str, tuple[object, str]]  # name -> (owner, attribute)
_MAX_DEPTH = 4


class Adapted(Protocol):
    """What the self-test needs from an adapter's cache."""

    def engine_callables(self) -> Callables:
        """Every engine function the adapter calls, as (owner, attribute)."""
        ...

    def engine_calls(self) -> Mapping[str, tuple[str, ...]]:
        """Op kind -> the names (keys of `engine_callables`) of the engine functions the
        adapter calls to apply an op of that kind."""
        ...

    def raw_probe(self) -> dict[str, Any]:
        """The engine's raw results of one probe admission (then undone)."""
        ...


class SelfTestResult(NamedTuple):
    """`problems` ([] = passed); `sources`: callable -> its source file; `substitutes`:
    how many shadowing substitutes were tried (every one must have been refused);
    `functions`: callable -> `path/in/package.py: Qualified.name`; `calls`: op kind ->
    the callables an op of that kind goes through."""

    problems: list[str]
    sources: dict[str, str]
    substitutes: int
    functions: dict[str, str]
    calls: dict[str, list[str]]


def check_callables(callables: Callables, package_dir: str) -> tuple[list[str], dict[str, str]]:
    """Problems with each (owner, attribute), and the source file of each good one."""
    root = os.path.realpath(package_dir) + os.sep
    problems: list[str] = []
    sources: dict[str, str] = {}
    for name, (owner, attr) in callables.items():
        obj = getattr(owner, attr)
        fn = getattr(obj, "__func__", obj)  # a bound method's or classmethod's function
        if is_stub(obj) or is_stub(fn):
            problems.append(f"{name}: is a stub or a mock ({type(obj).__name__})")
            continue
        if not inspect.isfunction(fn):
            problems.append(f"{name}: not a Python function ({type(fn).__name__})")
            continue
        src = inspect.getsourcefile(fn) or ""
        if not os.path.realpath(src).startswith(root):
            problems.append(f"{name}: defined in {src}, outside {package_dir}")
            continue
        sources[name] = src
    return problems, sources


def stubbed_modules(modules: tuple[str, ...]) -> list[str]:
    """The modules of `modules` that are stubs (or not imported at all)."""
    out = []
    for name in modules:
        module = sys.modules.get(name)
        if module is None or is_stub(module):
            out.append(f"module {name}: {'not imported' if module is None else 'a stub'}")
    return out


def find_mocks(value: Any, where: str = "result", depth: int = 0) -> list[str]:
    """Where inside `value` (containers, dataclasses, objects' attributes, a few levels
    down) a mock or a stub is; [] if nowhere."""
    if is_stub(value):
        return [f"{where}: {type(value).__name__}"]
    if depth >= _MAX_DEPTH or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return []
    items: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        items = [(f"{where}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f"{where}.{f.name}", getattr(value, f.name))
                 for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = [(f"{where}.{k}", v) for k, v in vars(value).items()]
    out: list[str] = []
    for path, v in items:
        out += find_mocks(v, path, depth + 1)
    return out


def _foreign(*args: Any, **kwargs: Any) -> None:
    """A function from outside any engine package: the self-test must refuse it."""


def _substitutes(name: str) -> list[tuple[str, Callable[..., Any]]]:
    return [("MagicMock", unittest.mock.MagicMock(name=name)),
            ("raising stub", raising_function(f"substitute.{name}", "self-test")),
            ("foreign function", _foreign)]


def _shadowed(owner: object, attr: str, fake: object, name: str, package_dir: str
              ) -> list[str]:
    """What `check_callables` says of `name` while `owner.attr` is `fake`; the
    attribute is restored after."""
    had = attr in vars(owner)
    before = vars(owner).get(attr)
    setattr(owner, attr, fake)
    try:
        return check_callables({name: (owner, attr)}, package_dir)[0]
    finally:
        if had:
            setattr(owner, attr, before)
        else:
            delattr(owner, attr)


def _functions(callables: Callables, sources: Mapping[str, str], package_dir: str
               ) -> dict[str, str]:
    """Each checked callable as `path/from/the/package's/parent.py: Qualified.name`."""
    top = os.path.dirname(os.path.realpath(package_dir))
    out = {}
    for name, src in sources.items():
        owner, attr = callables[name]
        fn = getattr(getattr(owner, attr), "__func__", getattr(owner, attr))
        out[name] = f"{os.path.relpath(os.path.realpath(src), top)}: {fn.__qualname__}"
    return out


def _calls(cache: Adapted, callables: Callables) -> tuple[dict[str, list[str]], list[str]]:
    """`cache.engine_calls()` as lists, and the problems with it (an op kind that is
    not one, a callable the adapter does not name)."""
    calls = {kind: list(names) for kind, names in cache.engine_calls().items()}
    problems = [f"engine_calls: {kind!r} is not an op kind" for kind in calls
                if kind not in KINDS]
    problems += [f"engine_calls[{kind!r}]: {name!r} is not one of engine_callables()"
                 for kind, names in calls.items() for name in names if name not in callables]
    return calls, problems


def engine_code(cache: Adapted, package_dir: str) -> dict[str, Any]:
    """The engine code `cache` goes through: "functions" (each engine function it calls
    whose source lies inside `package_dir`, as `path/from/the/package's/parent.py:
    Qualified.name`) and "calls" (op kind -> the names of those it calls), of this very
    cache, opened with whatever options it was: what a report names for a failing op
    (the self-test's own are of a plain cache's). Checks nothing, mutates nothing."""
    callables = cache.engine_callables()
    sources = check_callables(callables, package_dir)[1]
    return {"functions": _functions(callables, sources, package_dir),
            "calls": _calls(cache, callables)[0]}


def self_test(cache: Adapted, package_dir: str, modules: tuple[str, ...]) -> SelfTestResult:
    """Run the self-test on `cache` (a fresh one: its probe is undone, but its counters
    may have moved). Returns the problems found ([] = passed)."""
    callables = cache.engine_callables()
    problems, sources = check_callables(callables, package_dir)
    calls, wrong = _calls(cache, callables)
    problems += wrong
    problems += stubbed_modules(modules)
    problems += find_mocks(cache.raw_probe(), "raw_probe()")
    tried = 0
    for name, (owner, attr) in callables.items():
        for label, fake in _substitutes(name):
            tried += 1
            if not _shadowed(owner, attr, fake, name, package_dir):
                problems.append(f"{name}: a {label} put in its place was not refused")
    leftover = find_mocks({"mock": unittest.mock.MagicMock()})
    if not leftover:
        problems.append("find_mocks did not find a MagicMock in a result")
    return SelfTestResult(problems, sources, tried, _functions(callables, sources, package_dir),
                          calls)


def self_test_engine(engine: LoadedEngine) -> SelfTestResult:
    """`self_test` on a fresh cache of `engine` (16 blocks of 4 tokens: the probe fits)."""
    cache = engine.new(16, 4, True)
    return self_test(cache, engine.package_dir, engine.modules)  # type: ignore[arg-type]

"""Stand-ins for the modules of an engine's GPU stack that cannot run on a CPU: each raises.

Installed as a finder at the front of `sys.meta_path` before the engine is imported,
from a lock file's `stubs` (`StubSpec`):

- *absent*: a module that must not be importable: a top-level one must not be
  installed, a submodule must lie inside a raising stub. Importing it raises
  ModuleNotFoundError and `importlib.util.find_spec` says None, exactly as on a machine
  without it, so the engine's own fallbacks and availability probes take their real
  "missing" branch. Absent wins over a raising parent (`sgl_kernel.scalar_type`).
- *raising*: the import succeeds and yields a `RaisingModule` (a package: its
  submodules are raising modules too); reading any attribute it does not define raises
  `StubUsedError`. `names` defines the few names an engine imports at module level
  (`from x import f`): each is a function that raises `StubUsedError` when called.
- *overrides*: keys into `OVERRIDES`, the harness's own registry of a dependency's
  checks it answers itself (each says exactly what it replaces), applied by `install`
  after the finder: a check that would refuse what an engine does at import because a
  stubbed package is missing. Each needs its package primed and raising, so nothing of
  it is provided: a real use still touches the stub.

Never a MagicMock: a mocked decorator would replace the function under test, and a
truthy mocked probe (`is_xpu()`) would take the wrong branch. `StubUsedError` is not an
AttributeError, so `hasattr` and `getattr(m, x, default)` on a stub raise too instead of
quietly answering. `is_stub` recognises the stubs and any `unittest.mock` object (the
self-test refuses both). Standard library only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.conform.known_keys import check_keys

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_STUB_MARK = "__kvharness_stub__"


class StubUsedError(RuntimeError):
    """Code under test touched a stub: the stub list is wrong for this engine version.
    `stub` is what was touched (`module.name`), `module` the stub module it is in: never
    the engine's own failure, so a run that meets one cannot be trusted."""

    def __init__(self, stub: str, module: str, message: str) -> None:
        super().__init__(message)
        self.stub = stub
        self.module = module


class RaisingModule(types.ModuleType):
    """A module whose every undefined attribute raises StubUsedError."""

    def __getattr__(self, attr: str) -> Any:  # only called for names not defined on it
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # the import machinery's probes (__path__, ...)
        raise StubUsedError(f"{self.__name__}.{attr}", self.__name__,
                            f"{self.__name__}.{attr}: {self.__name__} is a stub "
                            f"({self.__dict__.get('__stub_reason__', '')})")


def raising_function(qualname: str, reason: str) -> Callable[..., Any]:
    """A function named `qualname` that raises StubUsedError when called."""
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise StubUsedError(qualname, module,
                            f"{qualname}() was called, but it is a stub ({reason})")
    module, _, name = qualname.rpartition(".")
    stub.__name__ = stub.__qualname__ = name
    stub.__module__ = module
    setattr(stub, _STUB_MARK, True)
    return stub


def _says_available() -> bool:
    """The answer an override gives (the package stays a raising stub)."""
    return True


def _torchvision_backend() -> None:
    """transformers' backend check for torchvision answers "available" from now on."""
    utils = importlib.import_module("transformers.utils.import_utils")
    _, message = utils.BACKENDS_MAPPING["torchvision"]
    utils.BACKENDS_MAPPING["torchvision"] = (_says_available, message)


@dataclass(frozen=True)
class Override:
    """A dependency's check the harness answers itself: `target` what it replaces,
    `what` its effect, `stub` the package it is about (primed and raising in the same
    spec), `apply` does it (mutates the dependency; once per process)."""

    target: str
    what: str
    stub: str
    apply: Callable[[], None]


# the overrides a lock may name (`stubs.overrides`), by key
OVERRIDES: dict[str, Override] = {
    "transformers-torchvision-backend": Override(
        "transformers.utils.import_utils.BACKENDS_MAPPING['torchvision']",
        "transformers' backend check for torchvision (what its lazy modules ask before "
        "importing a name, and requires_backends) answers available, so the "
        "AutoImageProcessor.register SGLang 0.5.12-0.5.21 make at import "
        "(configs/utils.py:18, from janus_pro.py) is accepted under the transformers they "
        "pin (5.6.0-5.12.1 refuse it without torchvision: huggingface/transformers#48607); "
        "is_torchvision_available() keeps its primed False and torchvision stays a raising "
        "stub, so any real use of it raises StubUsedError",
        "torchvision", _torchvision_backend)}


@dataclass(frozen=True)
class StubSpec:
    """What to stub, each module with the reason it cannot run here.

    absent/raising: module -> reason. names: raising module -> the names it defines
    as raising functions. prime: packages whose availability an engine's dependency
    caches, to be asked before they are stubbed (the adapter knows which probe).
    overrides: keys of `OVERRIDES`, applied by `install`.
    """

    absent: Mapping[str, str] = field(default_factory=dict)
    raising: Mapping[str, str] = field(default_factory=dict)
    names: Mapping[str, Sequence[str]] = field(default_factory=dict)
    prime: Sequence[str] = ()
    overrides: Sequence[str] = ()

    def __post_init__(self) -> None:
        for kind in ("absent", "raising"):
            for module, reason in getattr(self, kind).items():
                _check_module(module, f"stubs.{kind}")
                if not isinstance(reason, str) or not reason:
                    raise ValueError(f"stubs.{kind}[{module!r}]: give the reason it "
                                     "cannot run here")
        for module in self.absent:
            if "." in module and _root(module, self.raising) is None:
                raise ValueError(f"stubs.absent[{module!r}]: a submodule is absent only "
                                 "inside a raising stub (else its real package has it)")
        for module, names in self.names.items():
            if _root(module, self.raising) is None:
                raise ValueError(f"stubs.names[{module!r}]: not inside a raising stub "
                                 f"(raising: {sorted(self.raising)})")
            for name in names:
                if not isinstance(name, str) or not name.isidentifier():
                    raise ValueError(f"stubs.names[{module!r}]: {name!r} is not a name")
        for package in self.prime:
            _check_module(package, "stubs.prime")
        for key in self.overrides:
            if not isinstance(key, str) or key not in OVERRIDES:
                raise ValueError(f"stubs.overrides: {key!r} is not an override the harness "
                                 f"knows; known: {sorted(OVERRIDES)}")
            package = OVERRIDES[key].stub
            if package not in self.raising or package not in self.prime:
                raise ValueError(f"stubs.overrides: {key!r} needs {package!r} raising and "
                                 "primed (nothing of it is provided)")

    @classmethod
    def from_dict(cls, data: Any, where: str = "stubs") -> StubSpec:
        """Parse a lock file's `stubs`; ValueError naming `where` otherwise."""
        data = check_keys(data, ("absent", "raising", "names", "prime", "overrides"), where)
        try:
            return cls(dict(data.get("absent", {})), dict(data.get("raising", {})),
                       {k: tuple(v) for k, v in dict(data.get("names", {})).items()},
                       tuple(data.get("prime", ())), tuple(data.get("overrides", ())))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        """The lock file's form (`overrides` only where there are some)."""
        out: dict[str, Any] = {"absent": dict(self.absent), "raising": dict(self.raising),
                               "names": {k: list(v) for k, v in self.names.items()},
                               "prime": list(self.prime)}
        if self.overrides:
            out["overrides"] = list(self.overrides)
        return out

    @property
    def empty(self) -> bool:
        """Nothing to stub."""
        return not (self.absent or self.raising)


def _check_module(name: Any, where: str) -> None:
    if not isinstance(name, str) or not _MODULE.fullmatch(name):
        raise ValueError(f"{where}: {name!r} is not a dotted module name")


def _root(fullname: str, roots: Mapping[str, str]) -> str | None:
    for root in roots:
        if fullname == root or fullname.startswith(root + "."):
            return root
    return None


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the raising modules; absent ones are left to fail as missing modules do.
    `served` lists the modules it created, in order."""

    def __init__(self, spec: StubSpec) -> None:
        self.spec = spec
        self.served: list[str] = []

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if _root(fullname, self.spec.absent) is not None:
            return None  # no finder after this one has it (`install` and StubSpec check)
        if _root(fullname, self.spec.raising) is not None:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return RaisingModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        root = _root(module.__name__, self.spec.raising)
        assert root is not None  # find_spec serves only these
        reason = self.spec.raising[root]
        module.__dict__["__stub_reason__"] = reason
        module.__path__ = []  # a package: its submodules come here too
        for name in self.spec.names.get(module.__name__, ()):
            setattr(module, name, raising_function(f"{module.__name__}.{name}", reason))
        self.served.append(module.__name__)


def install(spec: StubSpec) -> StubFinder:
    """Put a finder for `spec` first on sys.meta_path, apply `spec.overrides` (after the
    caller primed the probes) and return the finder (mutates the interpreter; once per
    process). Raises ValueError when a stubbed module is already imported (a stub
    installed late stubs nothing) or an absent one is installed, RuntimeError naming the
    override when one does not apply to the installed dependency."""
    early = sorted(m for m in sys.modules if _root(m, {**spec.absent, **spec.raising}))
    if early:
        raise ValueError(f"stubs: {early} are already imported; install the stubs first")
    present = [m for m in spec.absent if "." not in m
               and importlib.machinery.PathFinder.find_spec(m) is not None]
    if present:
        raise ValueError(f"stubs: {present} must be absent but are installed here")
    finder = StubFinder(spec)
    sys.meta_path.insert(0, finder)
    for key in spec.overrides:
        try:
            OVERRIDES[key].apply()
        except (ImportError, AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RuntimeError(f"stubs.overrides: {key!r} does not apply here "
                               f"({OVERRIDES[key].target}: {type(exc).__name__}: {exc})"
                               ) from exc
    return finder


def is_stub(obj: object) -> bool:
    """Whether `obj` is a stub module, a stub function or a unittest.mock object."""
    if isinstance(obj, RaisingModule):
        return True
    if getattr(obj, "__dict__", {}).get(_STUB_MARK) is True:
        return True
    mock = sys.modules.get("unittest.mock")
    return mock is not None and isinstance(obj, mock.NonCallableMock)

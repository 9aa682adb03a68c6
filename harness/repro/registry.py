"""What a repro file may name, and what the harness builds for each name.

A recipe (harness.repro.workload.EngineRecipe) names its model, attention backend, engine
class, device and dtype as strings. A repro file is data: those strings select from this
registry and nothing else, and a name outside it is refused (a ReproFormatError naming
the field and the names it could be) before anything is imported or called. It holds
what the recorder (tests/scenarios/recording.py) can write:

- models: kvcache's presets (kvcache.model.config.PRESETS) and the model builders the
  scenario suites pass to `make_engine` instead of a preset (functions of the seed);
- attention backends: kvcache's registry (kvcache.attention.registry) and the suites'
  fault-injecting backends;
- engine classes: kvcache's Engine (null) and the suites' fault-injecting subclasses;
- devices `cpu`, `cuda`, `cuda:N`; dtypes float32, float16, bfloat16, float64 (the
  floating dtypes Engine's storage takes and a CPU or GPU can run).

A test object is listed in TEST_OBJECTS under the name the recorder writes for it
(`object_ref`: `module:QualName`); its module, spelled here and not in the file, is
imported only when a file names it (run `kvharness repro` from the repository root,
where `tests` imports). A test that records an object not listed here writes a file
`kvharness repro` refuses: list the object here to re-run it.

Like harness.repro.scenario_rerun, this loads kvcache (and torch) inside its functions only.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from harness.repro.fileformat import ReproFormatError

if TYPE_CHECKING:
    import torch

    from kvcache import Engine
    from kvcache.attention.base import AttentionBackend

Kind = Literal["model", "backend", "engine"]
DTYPES = ("float32", "float16", "bfloat16", "float64")
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,2})?")  # ASCII digits: `\d` is any Unicode digit


@dataclass(frozen=True)
class TestObject:
    """A test suite's model builder, backend or engine class a recipe may name."""

    kind: Kind
    module: str
    attr: str

    @property
    def name(self) -> str:
        """The recipe's name for it (what `object_ref` writes)."""
        return f"{self.module}:{self.attr}"

    def load(self, where: str) -> Any:
        """Import it. Raises ReproFormatError naming `where` when its module is not
        importable from here."""
        try:
            return getattr(importlib.import_module(self.module), self.attr)
        except (ImportError, AttributeError) as exc:
            raise ReproFormatError(f"{where}: {self.name} cannot be imported ({exc}); run "
                                   "kvharness repro from the repository root") from None


TEST_OBJECTS = (
    TestObject("model", "tests.scenarios.test_hybrid", "opaque_hybrid"),
    TestObject("backend", "tests.scenarios.faults", "StalePrefixBackend"),
    TestObject("engine", "tests.scenarios.faults", "OverCountingEngine"),
)
_TESTS = {(o.kind, o.name): o for o in TEST_OBJECTS}
_WORDS = {"model": "a model preset or builder", "backend": "an attention backend",
          "engine": "an engine class"}


class Resolved(NamedTuple):
    """What a recipe's names stand for: the model (a preset name Engine builds, or a
    builder called with the seed), the Engine class, the backend (a registered name or
    a class), the device and the dtype."""

    model: str | Callable[[int], Any]
    engine_class: type[Engine]
    backend: str | type[AttentionBackend]
    device: str
    dtype: torch.dtype


def object_ref(obj: Any) -> str:
    """The recipe's name of a backend, model builder or engine class: a name as given (a
    registered backend, a preset), or `module:QualName` for a class or function."""
    if isinstance(obj, str):
        return obj
    return f"{obj.__module__}:{obj.__qualname__}"


def names(kind: Kind) -> list[str]:
    """Every name a recipe may give for `kind`: kvcache's, then the test objects'."""
    if kind == "model":
        from kvcache.model.config import PRESETS

        builtin = list(PRESETS)
    elif kind == "backend":
        from kvcache.attention.registry import backend_names

        builtin = list(backend_names())
    else:
        builtin = []
    return builtin + [o.name for o in TEST_OBJECTS if o.kind == kind]


def _check(kind: Kind, name: str | None, where: str) -> None:
    """Refuse `name` unless the registry holds it (None: kvcache's Engine). Imports
    nothing `name` could select."""
    if name is None and kind == "engine":
        return
    known = names(kind)
    if name not in known:
        if kind == "engine":
            known = ["null (kvcache's Engine)", *known]
        raise ReproFormatError(f"{where}: {name!r} is not {_WORDS[kind]} kvharness repro "
                               f"can build; it builds {', '.join(known)} "
                               "(harness/repro/registry.py)")


def _load(kind: Kind, name: str, where: str) -> Any:
    """The test object `name` names, else `name` itself (kvcache's own)."""
    test = _TESTS.get((kind, name))
    return name if test is None else test.load(where)


def resolve(preset: str, engine: str | None, backend: str, device: str, dtype: str,
            where: str) -> Resolved:
    """What a recipe's names stand for; `where` is the recipe's path (errors name
    `<where>.preset`, `.engine`, ...). Every name is checked before any test object is
    imported. Raises ReproFormatError for a name outside the registry, a test object
    that cannot be imported, or a CUDA device on a machine without CUDA. Reads only."""
    import torch

    from kvcache import Engine

    _check("model", preset, f"{where}.preset")
    _check("engine", engine, f"{where}.engine")
    _check("backend", backend, f"{where}.backend")
    if not _DEVICE.fullmatch(device):
        raise ReproFormatError(f"{where}.device: {device!r} is not a device kvharness repro "
                               "runs on; expected cpu, cuda or cuda:N")
    if dtype not in DTYPES:
        raise ReproFormatError(f"{where}.dtype: {dtype!r} is not a dtype kvharness repro "
                               f"runs; expected one of {', '.join(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ReproFormatError(f"{where}.device: the record ran on {device!r}; this machine "
                               "has no CUDA")
    engine_class = Engine if engine is None else _load("engine", engine, f"{where}.engine")
    return Resolved(_load("model", preset, f"{where}.preset"), engine_class,
                    _load("backend", backend, f"{where}.backend"), device,
                    getattr(torch, dtype))

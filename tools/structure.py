"""The code's structure in numbers: what docs/architecture.md's rules promise, measured.

    python tools/structure.py            # the table, for the packages of this checkout
    python tools/structure.py --json     # the same as JSON

It reads the sources as text (ast), runs none of them, and reports per package: files,
functions longer than `--max-lines` lines, reads and writes of another object's
underscore fields (`other._x`: an object's underscore fields are its own), imports of
another module's private names (`from a import _x`), and for each top-level package
the import picture of its rooms (a room is a module or a subpackage directly inside
it): how many rooms, how many arrows between them (room A imports room B), and the
loops (rooms that import each other in a cycle), and the file loops: files that import
each other in a cycle when the code runs (imports inside functions count; those under
`if TYPE_CHECKING:`, type hints only, do not), then the same counting type hints too (a
circle through type hints is no failure at run time, but a reader still cannot read
one of its files without the others). harness.conform gets a picture of its own (its
three places and the modules they share). tests/harness/test_rooms.py and
tests/tools/test_structure.py hold the code to the rules the numbers stand for.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "harness")
PICTURES = (*PACKAGES, "harness.conform")  # the packages whose rooms are drawn
MAX_LINES = 60
SELF_NAMES = frozenset({"self", "cls"})


@dataclass(frozen=True)
class Finding:
    """One place a rule is broken: `path:line` and what stands there."""

    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


@dataclass
class PackageFigures:
    """The figures of one package (its own modules, not its subpackages')."""

    name: str
    files: int = 0
    long_functions: list[Finding] = field(default_factory=list)
    foreign_underscores: list[Finding] = field(default_factory=list)
    private_imports: list[Finding] = field(default_factory=list)


@dataclass(frozen=True)
class ImportPicture:
    """The rooms directly inside a package and the imports between them."""

    package: str
    rooms: tuple[str, ...]
    arrows: tuple[tuple[str, str], ...]
    loops: tuple[tuple[str, ...], ...]
    files: int = 0
    file_loops: tuple[tuple[str, ...], ...] = ()
    hinted_file_loops: tuple[tuple[str, ...], ...] = ()  # type hints counted too


def module_name(path: Path, root: Path = ROOT) -> str:
    """`kvcache/core/pool.py` -> `kvcache.core.pool` (a package's `__init__` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(package: str, root: Path = ROOT) -> Iterator[Path]:
    """Every .py file of `package`, in path order."""
    yield from sorted((root / package).rglob("*.py"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# A NamedTuple's public methods carry an underscore only so they cannot clash with a
# field's name (the collections docs say so): calling them is no private access.
NAMEDTUPLE_API = frozenset({"_asdict", "_field_defaults", "_fields", "_make", "_replace"})


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


Import = ast.Import | ast.ImportFrom


@dataclass(frozen=True)
class Source:
    """One file read once: the nodes of its tree the figures look at, gathered in one walk
    (in `ast.walk`'s order)."""

    imports: tuple[Import, ...]  # every import, anywhere in the file
    run_time: tuple[Import, ...]  # the same less those under `if TYPE_CHECKING:`
    functions: tuple[ast.FunctionDef | ast.AsyncFunctionDef, ...]
    attributes: tuple[ast.Attribute, ...]


def read(path: Path) -> Source:
    """`path` parsed and walked, once for as long as the file is unchanged (the measures
    and the pictures of one run, and of the tests that run several, share it). Raises
    SyntaxError naming the file for a file Python cannot parse."""
    stat = path.stat()
    return _read(path, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _read(path: Path, mtime_ns: int, size: int) -> Source:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    hinted = {id(node) for block in tree.body if _is_type_checking(block)
              for node in ast.walk(block)}
    imports: list[Import] = []
    functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    attributes: list[ast.Attribute] = []
    for node in ast.walk(tree):
        if isinstance(node, Import):
            imports.append(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            functions.append(node)
        elif isinstance(node, ast.Attribute):
            attributes.append(node)
    return Source(tuple(imports), tuple(n for n in imports if id(n) not in hinted),
                  tuple(functions), tuple(attributes))


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The modules a file imports, anywhere in it (type-checking and local imports too);
    `from a import b` counts as importing `a.b` as well, since b may be a module."""
    return _targets((n for n in ast.walk(tree) if isinstance(n, Import)), module, is_package)


def _targets(imports: Iterable[Import], module: str, is_package: bool) -> set[str]:
    """What `imported_modules` says of these import statements of `module`."""
    found: set[str] = set()
    for node in imports:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            target = _resolve(module, node, is_package)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): a block for type checkers only."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _long_functions(source: Source, rel: str, max_lines: int) -> list[Finding]:
    found = []
    for node in source.functions:
        assert node.end_lineno is not None
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        lines = node.end_lineno - first + 1
        if lines > max_lines:
            found.append(Finding(rel, node.lineno, f"{node.name}: {lines} lines"))
    return found


def _foreign_underscores(source: Source, rel: str) -> list[Finding]:
    """`x._field` where x is not self, cls or `super()` (the object's own fields, a
    base class's hook among them): another object's underscore field (a NamedTuple's
    `_replace` and its kin are public, and not counted)."""
    found = []
    for node in source.attributes:
        if not _is_private(node.attr) or node.attr in NAMEDTUPLE_API:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in SELF_NAMES:
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) \
                and owner.func.id == "super":
            continue
        found.append(Finding(rel, node.lineno, f"{ast.unparse(owner)}.{node.attr}"))
    return found


def _private_imports(source: Source, rel: str, module: str, is_package: bool
                     ) -> list[Finding]:
    """`from other import _name`: another module's private name."""
    found = []
    for node in source.imports:
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, node, is_package)
            for alias in node.names:
                if _is_private(alias.name) and target != module:
                    found.append(Finding(rel, node.lineno, f"from {target} import {alias.name}"))
    return found


def measure(packages: tuple[str, ...] = PACKAGES, root: Path = ROOT,
            max_lines: int = MAX_LINES) -> dict[str, PackageFigures]:
    """Figures per package (dotted name), for every package under `packages`."""
    figures: dict[str, PackageFigures] = {}
    for top in packages:
        for path in sources(top, root):
            rel = path.relative_to(root).as_posix()
            module = module_name(path, root)
            is_package = path.name == "__init__.py"
            package = module if is_package else module.rpartition(".")[0]
            figs = figures.setdefault(package, PackageFigures(package))
            source = read(path)
            figs.files += 1
            figs.long_functions += _long_functions(source, rel, max_lines)
            figs.foreign_underscores += _foreign_underscores(source, rel)
            figs.private_imports += _private_imports(source, rel, module, is_package)
    return dict(sorted(figures.items()))


def import_picture(package: str, root: Path = ROOT) -> ImportPicture:
    """The rooms directly inside `package` (modules, and subpackages as one room each;
    `__init__` is none), the arrows between them and the loops among them."""
    base = root / package.replace(".", "/")
    rooms = sorted(p.stem if p.is_file() else p.name for p in base.iterdir()
                   if (p.suffix == ".py" and p.name != "__init__.py")
                   or (p.is_dir() and (p / "__init__.py").exists()))
    prefix = f"{package}."
    arrows: set[tuple[str, str]] = set()
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if rel.parts == ("__init__.py",):
            continue
        room = rel.parts[0] if len(rel.parts) > 1 else path.stem
        module = module_name(path, root)
        for target in _targets(read(path).imports, module, path.name == "__init__.py"):
            if target.startswith(prefix):
                other = target[len(prefix):].split(".")[0]
                if other in rooms and other != room:
                    arrows.add((room, other))
    files, file_arrows = _file_arrows(package, root)
    _, hinted_arrows = _file_arrows(package, root, hints=True)
    return ImportPicture(package, tuple(rooms), tuple(sorted(arrows)),
                         _loops(rooms, arrows), len(files), _loops(files, file_arrows),
                         _loops(files, hinted_arrows))


def _file_arrows(package: str, root: Path,
                 hints: bool = False) -> tuple[list[str], set[tuple[str, str]]]:
    """The modules of `package` (all of its files, `__init__` as the package) and the
    imports between them that run (`Source.run_time`; with `hints`, every import)."""
    paths = sorted((root / package.replace(".", "/")).rglob("*.py"))
    names = [module_name(p, root) for p in paths]
    known = set(names)
    arrows: set[tuple[str, str]] = set()
    for path, module in zip(paths, names, strict=True):
        source = read(path)
        targets = _targets(source.imports if hints else source.run_time, module,
                           path.name == "__init__.py")
        for target in targets:
            if target in known and target != module:
                arrows.add((module, target))
    return names, arrows


def _loops(rooms: list[str], arrows: set[tuple[str, str]]) -> tuple[tuple[str, ...], ...]:
    """The strongly connected groups of more than one room (Tarjan's algorithm)."""
    edges: dict[str, list[str]] = {r: [] for r in rooms}
    for a, b in arrows:
        edges[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[tuple[str, ...]] = []

    def visit(room: str) -> None:
        index[room] = low[room] = len(index)
        stack.append(room)
        on_stack.add(room)
        for nxt in edges[room]:
            if nxt not in index:
                visit(nxt)
                low[room] = min(low[room], low[nxt])
            elif nxt in on_stack:
                low[room] = min(low[room], index[nxt])
        if low[room] == index[room]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == room:
                    break
            if len(group) > 1:
                groups.append(tuple(sorted(group)))

    for room in rooms:
        if room not in index:
            visit(room)
    return tuple(sorted(groups))


def _table(figures: dict[str, PackageFigures], pictures: list[ImportPicture],
           max_lines: int) -> str:
    lines = [f"| package | files | functions over {max_lines} lines | other objects' "
             "underscore fields | private names imported |", "|---|---|---|---|---|"]
    for name, figs in figures.items():
        lines.append(f"| {name} | {figs.files} | {len(figs.long_functions)} | "
                     f"{len(figs.foreign_underscores)} | {len(figs.private_imports)} |")
    for pic in pictures:
        lines += ["", f"{pic.package}: {len(pic.rooms)} rooms, {len(pic.arrows)} arrows, "
                  f"{len(pic.loops)} loops ({_named(pic.loops)}); {pic.files} files, "
                  f"{len(pic.file_loops)} file loops ({_named(pic.file_loops)}), "
                  f"{len(pic.hinted_file_loops)} counting type hints "
                  f"({_named(pic.hinted_file_loops)})"]
    return "\n".join(lines)


def _named(loops: tuple[tuple[str, ...], ...]) -> str:
    return "; ".join(" <-> ".join(loop) for loop in loops) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    parser.add_argument("--max-lines", type=int, default=MAX_LINES,
                        help=f"a function longer than this is counted (default {MAX_LINES})")
    parser.add_argument("--details", action="store_true",
                        help="list every finding under the table")
    args = parser.parse_args(argv)
    figures = measure(max_lines=args.max_lines)
    pictures = [import_picture(p) for p in PICTURES]
    if args.json:
        print(json.dumps({"packages": {k: asdict(v) for k, v in figures.items()},
                          "pictures": [asdict(p) for p in pictures]}, indent=2))
        return 0
    print(_table(figures, pictures, args.max_lines))
    if args.details:
        for figs in figures.values():
            for finding in (*figs.long_functions, *figs.foreign_underscores,
                            *figs.private_imports):
                print(finding)
    return 0


if __name__ == "__main__":
    sys.exit(main())

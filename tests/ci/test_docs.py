"""The README is a front door that stays true: its examples run as written (doctest), its
sessions table names every nox session, it carries no dated figure (those live in
docs/performance.md), and every relative link of the README and the docs resolves, file
and heading."""

from __future__ import annotations

import ast
import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "test_lists" / "SCHEMA.md"]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """`text` without its fenced code blocks, whose `#` lines and brackets are code."""
    return FENCE.sub("", text)


def _anchors(text: str) -> set[str]:
    """The heading anchors GitHub renders for markdown `text`: lower case, punctuation but
    `-` and `_` dropped, spaces as hyphens; a repeated heading gets `-1`, `-2`, ..."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", _prose(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = counts.get(slug, 0)
        counts[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _session_names() -> list[str]:
    """Every function noxfile.py decorates with `@nox.session`, read without importing nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    names = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            target = deco.func if isinstance(deco, ast.Call) else deco
            if ast.unparse(target) == "nox.session":
                names.append(node.name)
    return names


def test_the_readme_examples_run_as_written() -> None:
    """Each ```pycon block of the README is a doctest: every shown result is what the code
    returns now, in a fresh namespace per block."""
    text = README.read_text()
    blocks = [(m.group(1), text.count("\n", 0, m.start(1))) for m in FENCE.finditer(text)
              if m.group(0).startswith("```pycon")]
    assert blocks, "the README shows no ```pycon example"
    parser = doctest.DocTestParser()
    for number, (block, line) in enumerate(blocks, 1):
        test = parser.get_doctest(block, {}, f"README example {number}", str(README), line)
        report: list[str] = []
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        result = runner.run(test, out=report.append, clear_globs=True)
        assert result.failed == 0, "".join(report)


def test_the_readme_names_every_nox_session() -> None:
    """The sessions table has a row for each session noxfile.py defines, and no other."""
    sessions = _session_names()
    assert "premerge" in sessions, sessions  # the reader found the sessions
    rows = re.findall(r"^\| `nox -s ([\w-]+)", README.read_text(), re.M)
    assert sorted(rows) == sorted(sessions)


def test_the_readme_carries_no_dated_figure() -> None:
    """Dated measurements belong to docs/performance.md, never to the front door."""
    dated = [line for line in README.read_text().splitlines()
             if re.search(r"\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b", line)]
    assert dated == []


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_relative_link_resolves(doc: Path) -> None:
    """A link to a file names one that exists; a link to a heading names one that the
    target renders (GitHub's anchors)."""
    broken = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert broken == [], "\n".join(broken)

"""The entry index: the entries covering a node id, found by its prefixes, are exactly
those `Entry.covers` accepts, most specific first and then in list order, so `resolve`
picks what trying every entry picked (collection-cost work of issue 26)."""

from __future__ import annotations

from harness.lists.db import EntryIndex, resolve
from harness.lists.entry import Entry, parse_entry_text

TEXTS = [
    "tests",
    "tests/unit",
    "tests/unit/test_a.py",
    "tests/unit/test_a.py::TestGroup",
    "tests/unit/test_a.py::TestGroup::test_m",
    "tests/unit/test_a.py::test_p",
    "tests/unit/test_a.py::test_p[x/y]",
    'tests/unit -k "p and not slow"',
    "tests/unit/test_a.py::test_p[x",  # a prefix inside the parameters ends before "/"
    "tests/unit/test_ab.py",
    "tests/unit/test_a.py::test_p",  # the same text again: list order among equals
    "tests/unit/test_gone.py",
]
NODE_IDS = [
    "tests/unit/test_a.py::TestGroup::test_m",
    "tests/unit/test_a.py::TestGroup::test_m2",
    "tests/unit/test_a.py::test_p[x/y]",
    "tests/unit/test_a.py::test_p[x/y/z]",
    "tests/unit/test_a.py::test_p[slow]",
    "tests/unit/test_a.py::test_pq",
    "tests/unit/test_ab.py::test_q",
    "tests/unitx/test_a.py::test_p",
    "tests/other.py::test_p",
    "other/test_a.py::test_p",
]


def _entries() -> list[Entry]:
    return [parse_entry_text(text) for text in TEXTS]


def _by_trying_every_entry(entries: list[Entry], node_id: str) -> list[Entry]:
    by_length = sorted(entries, key=lambda e: -len(e.test))  # stable: list order
    return [e for e in by_length if e.covers(node_id)]


def test_the_index_finds_what_trying_every_entry_finds() -> None:
    entries = _entries()
    index = EntryIndex(entries)
    for node_id in NODE_IDS:
        assert [id(e) for e in index.covering(node_id)] == [
            id(e) for e in _by_trying_every_entry(entries, node_id)], node_id
    assert index.covering("other/test_a.py::test_p") == []
    found = index.covering("tests/unit/test_a.py::test_p[x/y]")
    assert [e.text for e in found[:3]] == ["tests/unit/test_a.py::test_p[x/y]",
                                           "tests/unit/test_a.py::test_p[x",
                                           "tests/unit/test_a.py::test_p"]


def test_resolve_picks_the_most_specific_then_the_first_listed() -> None:
    entries = _entries()
    resolution = resolve(entries, NODE_IDS)
    assert resolution.chosen["tests/unit/test_a.py::TestGroup::test_m2"] is entries[3]
    assert resolution.chosen["tests/unit/test_a.py::test_p[slow]"] is entries[5]  # not [10]
    assert resolution.chosen["tests/unit/test_ab.py::test_q"] is entries[9]
    assert resolution.chosen["tests/unitx/test_a.py::test_p"] is entries[0]
    assert "other/test_a.py::test_p" not in resolution.chosen
    # An entry that covers a test counts as used even where a more specific one was chosen.
    assert resolution.unmatched == (entries[11],)

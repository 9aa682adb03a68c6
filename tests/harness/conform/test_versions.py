"""Release numbers: pip's order (dev, pre, final, post, local), and the nearest known
release a version without a lock or contract takes."""

from __future__ import annotations

import pytest

from harness.conform.versions import nearest, parse_version, sort_versions


def test_versions_sort_as_pip_sorts_them() -> None:
    want = ["0.5.5", "0.5.5.post1", "0.5.5.post3", "0.5.6.dev2", "0.5.6rc1", "0.5.6",
            "0.5.6+local", "0.5.6.post2", "0.5.10", "0.10.1", "0.10.1.1", "0.10.2"]
    assert sort_versions(reversed(want)) == want


@pytest.mark.parametrize(("text", "release", "is_release"), [
    pytest.param("0.33.0", (0, 33, 0), True, id="final"),
    pytest.param("0.5.6.post2", (0, 5, 6), True, id="post"),
    pytest.param("0.10.1.1", (0, 10, 1, 1), True, id="four-part"),
    pytest.param("0.33.1.dev3+gabc1234", (0, 33, 1), False, id="dev-local"),
    pytest.param("0.34.0rc1", (0, 34, 0), False, id="rc"),
])
def test_a_version_parses(text: str, release: tuple[int, ...], is_release: bool) -> None:
    v = parse_version(text)
    assert (v.release, v.is_release, v.text) == (release, is_release, text)


@pytest.mark.parametrize("text", ["latest", "0", "v0.33.0", "0.33.0-1", "0.33.0.post", ""])
def test_a_bad_version_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=rf"{text!r} is not a version"):
        parse_version(text)


KNOWN = ["0.10.2", "0.16.0", "0.28.0", "0.33.0"]


@pytest.mark.parametrize(("version", "want"), [
    pytest.param("0.28.0", "0.28.0", id="itself"),
    pytest.param("0.30.0", "0.28.0", id="newest-older"),
    pytest.param("0.27.1", "0.16.0", id="patch-between"),
    pytest.param("0.33.1.dev3+gabc1234", "0.33.0", id="dev-after"),
    pytest.param("0.33.0.dev7", "0.28.0", id="dev-before-its-release"),
    pytest.param("0.34.0", "0.33.0", id="newer-than-all"),
    pytest.param("0.9.2", "0.10.2", id="older-than-all"),
])
def test_the_nearest_known_release_is_the_newest_not_newer(version: str, want: str) -> None:
    assert nearest(version, KNOWN) == want


def test_nothing_known_is_none() -> None:
    assert nearest("0.1.0", []) is None

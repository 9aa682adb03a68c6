"""`-k "expr"` on a list entry, as TensorRT-LLM writes `unittest/... -k "partition0"`.

The grammar is pytest's `-k`: names joined by `and`, `or`, `not` and parentheses; a name
matches when it is a case-insensitive substring of one of the test's names. The names
come from the node id alone (its folders, file, classes and function with parameters),
so `kvharness validate` (which sees only collected ids) and a run agree; unlike pytest's
`-k`, marker names do not match.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from harness.data_files import MAX_NESTING, too_deep

_TOKEN = re.compile(r"\s*(?:(?P<paren>[()])|(?P<word>[\w:+\-.\[\]\\/]+))")
_OPERATORS = ("and", "or", "not")
_NESTS = "parentheses and 'not'"
MAX_EXPRESSION_CHARS = 1000  # a list entry, not a program

Matcher = Callable[[str], bool]


def node_names(node_id: str) -> tuple[str, ...]:
    """The names `-k` matches for `node_id`: each path part, class and function."""
    path, _, inner = node_id.partition("::")
    return (*path.split("/"), *(inner.split("::") if inner else ()))


class _Parser:
    """Recursive descent over `or_expr := and_expr (or and_expr)*`,
    `and_expr := not_expr (and not_expr)*`, `not_expr := not not_expr | ( or_expr ) | name`.
    It recurses once for each `(` and `not` it is inside, so it refuses more than
    MAX_NESTING of them around a name (within 1,000 characters, 497 parentheses would
    exhaust Python's recursion limit)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.depth = 0
        self.tokens: list[tuple[int, str]] = []
        pos = 0
        while text[pos:].strip():
            match = _TOKEN.match(text, pos)
            if match is None:
                bad = text[pos:].strip()[0]
                raise ValueError(f"-k {text!r}: unexpected character {bad!r} at column "
                                 f"{text.index(bad, pos) + 1}")
            self.tokens.append((match.start(match.lastgroup or 0), match[0].strip()))
            pos = match.end()
        self.at = 0

    def _peek(self) -> str | None:
        return self.tokens[self.at][1] if self.at < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ValueError(f"-k {self.text!r}: ends early; expected a name, 'not' or '('")
        self.at += 1
        return token

    def parse(self) -> Callable[[Matcher], bool]:
        if not self.tokens:
            raise ValueError("-k with an empty expression")
        tree = self._or()
        if self._peek() is not None:
            column = self.tokens[self.at][0] + 1
            raise ValueError(f"-k {self.text!r}: unexpected {self._peek()!r} at column {column}")
        return tree

    def _or(self) -> Callable[[Matcher], bool]:
        parts = [self._and()]
        while self._peek() == "or":
            self.at += 1
            parts.append(self._and())
        return parts[0] if len(parts) == 1 else (lambda m: any(p(m) for p in parts))

    def _and(self) -> Callable[[Matcher], bool]:
        parts = [self._not()]
        while self._peek() == "and":
            self.at += 1
            parts.append(self._not())
        return parts[0] if len(parts) == 1 else (lambda m: all(p(m) for p in parts))

    def _nested(self, parse: Callable[[], Callable[[Matcher], bool]]) -> Callable[[Matcher], bool]:
        """`parse()` one level deeper; raises ValueError past MAX_NESTING levels."""
        if self.depth == MAX_NESTING:
            column = self.tokens[self.at - 1][0] + 1
            raise ValueError(f"-k {self.text!r}: {too_deep(_NESTS)} (column {column})")
        self.depth += 1
        try:
            return parse()
        finally:
            self.depth -= 1

    def _not(self) -> Callable[[Matcher], bool]:
        token = self._take()
        if token == "not":
            inner = self._nested(self._not)
            return lambda m: not inner(m)
        if token == "(":
            inner = self._nested(self._or)
            if self._take() != ")":
                raise ValueError(f"-k {self.text!r}: '(' without its ')'")
            return inner
        if token == ")" or token in _OPERATORS:
            raise ValueError(f"-k {self.text!r}: expected a name, got {token!r}")
        word = token.lower()
        return lambda m: m(word)


@dataclass(frozen=True)
class KeywordExpr:
    """A parsed `-k` expression; `text` is what the list says."""

    text: str
    _tree: Callable[[Matcher], bool]

    @classmethod
    def parse(cls, text: str, flag: str = "-k") -> KeywordExpr:
        """Parse `text` (given after `flag`, -k or -m: pytest's grammar is one); raises
        ValueError naming the flag, the expression and the bad token."""
        if len(text) > MAX_EXPRESSION_CHARS:
            raise ValueError(f"{flag} expression of {len(text)} characters; at most "
                             f"{MAX_EXPRESSION_CHARS}")
        try:
            return cls(text, _Parser(text).parse())
        except ValueError as exc:
            if flag == "-k":
                raise
            raise ValueError(str(exc).replace("-k", flag, 1)) from None

    def matches_marks(self, marks: Iterable[str]) -> bool:
        """True if the expression holds as pytest's `-m` reads it: a name holds when a
        marker of that name is on the test (ignoring case)."""
        names = {m.lower() for m in marks}
        return self._tree(lambda word: word in names)

    def matches(self, node_id: str) -> bool:
        """True if the expression holds for the names of `node_id`."""
        names = [n.lower() for n in node_names(node_id)]
        return self._tree(lambda word: any(word in n for n in names))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeywordExpr) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

"""Where two runs' outputs first differ: the check behind "warm equals cold".

`first_difference(expected, actual, atol)` walks the outputs pairwise and returns the
first `Difference`: a count mismatch, a generated token, or a logit beyond `atol`
(|actual - expected| <= atol, rtol 0, as `torch.testing.assert_close(rtol=0)`; NaN
never matches). A scenario's assertion and `kvharness repro` both describe it with
`describe`, so a replay prints the failure in the test's own words.

Outputs are read through `request_id`, `prompt`, `token_ids` and `logits` (a
`[steps, vocab]` tensor, or None); the logits are read with tensor methods only, so this
module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

DiffKind = Literal["count", "tokens", "no_logits", "logits_shape", "logits"]


class Difference(NamedTuple):
    """The first difference; `position` is the pair's index in the output lists, `step`
    the generated position (token or logits row) where they part (None: count, shape,
    no logits). `max_abs_diff` is the largest logit difference at that step."""

    kind: DiffKind
    position: int | None
    expected_request: int | None
    actual_request: int | None
    prompt_len: int | None
    step: int | None
    expected_tokens: list[int] | None
    actual_tokens: list[int] | None
    max_abs_diff: float | None
    atol: float
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return self._asdict()


def _request_id(out: Any) -> int | None:
    return out.request_id if isinstance(out.request_id, int) else None


def first_difference(expected: Sequence[Any], actual: Sequence[Any], atol: float
                     ) -> Difference | None:
    """The first way `actual` differs from `expected` (None: they agree). Reads only."""
    if len(actual) != len(expected):
        return Difference("count", None, None, None, None, None, None, None, None, atol,
                          f"{len(actual)} outputs, {len(expected)} expected")
    for i, (exp, act) in enumerate(zip(expected, actual, strict=True)):
        head = (i, _request_id(exp), _request_id(act), len(act.prompt))
        want, got = list(exp.token_ids), list(act.token_ids)
        if want != got:
            step = next((s for s, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                        min(len(want), len(got)))
            return Difference("tokens", *head, step, want, got, None, atol)
        if exp.logits is None or act.logits is None:
            return Difference("no_logits", *head, None, want, got, None, atol)
        if tuple(exp.logits.shape) != tuple(act.logits.shape):
            return Difference("logits_shape", *head, None, want, got, None, atol,
                              f"{tuple(act.logits.shape)} vs {tuple(exp.logits.shape)}")
        diff = (act.logits.double() - exp.logits.double()).abs()
        bad = ~(diff <= atol)  # NaN compares False: a NaN logit is a difference
        if bool(bad.any()):
            step = int(bad.any(dim=-1).nonzero()[0, 0])
            worst = float(diff[step].nan_to_num(nan=float("inf")).max())
            return Difference("logits", *head, step, want, got, worst, atol,
                              f"{int(bad.sum())} of {bad.numel()} logits beyond atol")
    return None


def describe(diff: Difference, where: str) -> str:
    """The failure in words, e.g. `warm vs cold: request 3 (prompt of 12 tokens):
    logits differ from step 0: max |diff| 0.31 > atol 1e-05 (7 of 2000 logits)`."""
    if diff.kind == "count":
        return f"{where}: {diff.detail}"
    ref = ("" if diff.expected_request == diff.actual_request
           else f"; the reference is request {diff.expected_request}")
    who = f"{where}: request {diff.actual_request} (prompt of {diff.prompt_len} tokens{ref})"
    if diff.kind == "tokens":
        return (f"{who} generated {diff.actual_tokens}, the reference {diff.expected_tokens}; "
                f"they part at generated token {diff.step}")
    if diff.kind == "no_logits":
        return f"{who}: no logits kept"
    if diff.kind == "logits_shape":
        return f"{who}: logits of shape {diff.detail}"
    return (f"{who}: logits differ from generated token {diff.step}: max |diff| "
            f"{diff.max_abs_diff:.6g} > atol {diff.atol:g} ({diff.detail})")

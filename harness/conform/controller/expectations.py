"""A family's own expectations as data, judged on the step reports of its op list: the
same way while the check runs and when a replay file re-runs it.

A family drives its ops through `families.Run` and declares what must hold of their
results; each declaration is an `Expectation`, data only: `name` selects a judge from
`EXPECTATIONS` (the harness's own registry: a replay file can select nothing else) and
`params` are its JSON parameters, each checked before use (`from_json`). Registered:

    result                 the op at `step` returned `want` ("what" says what that is):
                           admit the tokens reused, reserve the tokens scheduled, append
                           the blocks allocated, evict the blocks evicted; None refused
    admitted               the admission at `step` happened
    done                   the op at `step` was not skipped (the family's bookkeeping
                           of what is live and computed holds)
    freed                  the op at `step` gave back `want` blocks (the cache's used
                           blocks before it, less after it)
    distinct_event_hashes  the same prompt computed in each of `scopes` (the steps
                           `first`..`last`): two scopes that differ in a kind the contract
                           says reaches event hashes publish different block-0 hashes;
                           a pair that differs only in a kind the contract names a known
                           limitation is that limitation, not a failure
    preempted              the op at `step` preempted the sequences `want`, in order
    status                 the op at `step` ended with status `want` (a StepReport's)
    scheduled              the tokens scheduled after each of `steps` (an admission's
                           scheduled_tokens, a reserve's value; None where it did not
                           happen) are `want`
    evicted                the blocks the op at `step` removed (its BlockRemoved hashes)
                           are those the steps `first`..`last` stored (`which` "all"), or
                           the last of them ("last")
    event_fields           the same prompt computed cold in each of `scopes`: each field
                           the contract's `event_fields` names says what it should of
                           that scope's BlockStored events

`judge` returns each expectation that did not hold as an `Unmet`. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, get_args

from harness.conform.known_keys import check_keys
from harness.conform.protocol import Contract, Scope
from harness.conform.worker.session import Status, StepReport

MAX_LABEL_CHARS = 500  # a `what` or a scope label: a sentence, not a document


class Expectation(NamedTuple):
    """A registered expectation (`name`, a key of EXPECTATIONS) and its parameters."""

    name: str
    params: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {"name": self.name, "params": self.params}


class Unmet(NamedTuple):
    """An expectation that did not hold at op `step`: `message` says how; `limitation`
    is the upstream link when the contract names it a known limitation (None: a
    failure of the engine)."""

    step: int
    message: str
    limitation: str | None = None


def result_of(report: StepReport) -> int | None:
    """What the op of `report` returned, as the family reads it: an admission's reused
    tokens, a reserve's scheduled tokens, an append's allocated blocks, an eviction's
    evicted blocks; None when it did not happen (refused, skipped or raised)."""
    if report.status != "done":
        return None
    kind, value = report.op.kind, report.value
    if kind == "admit":
        return int(value["reused_tokens"])
    if kind == "append":
        return len(value)
    return value if kind in ("reserve", "evict") else None


def first_stored_hash(reports: Sequence[StepReport]) -> str | None:
    """The hash of the first block 0 (a BlockStored without a parent) in `reports`."""
    for r in reports:
        for e in r.events:
            if e.get("type") == "BlockStored" and e.get("parent_block_hash") is None:
                return str(e["block_hashes"][0])
    return None


def _differ(x: Scope | None, y: Scope | None) -> set[str]:
    """The scope kinds in which `x` and `y` differ."""
    x, y = x or Scope(), y or Scope()
    kinds = {"salt"} if x.salt != y.salt else set()
    if (x.lora_name, x.lora_id, x.lora_path) != (y.lora_name, y.lora_id, y.lora_path):
        kinds.add("lora")
    if x.extra_key != y.extra_key:
        kinds.add("extra_key")
    return kinds


# -- the judges: (params, contract, reports) -> what did not hold -------------------------


def _result(p: Mapping[str, Any], contract: Contract, reports: Sequence[StepReport]
            ) -> list[Unmet]:
    got = result_of(reports[p["step"]])
    if got == p["want"]:
        return []
    return [Unmet(p["step"], f"{p['what']}: got {got!r}, expected {p['want']!r}")]


def _admitted(p: Mapping[str, Any], contract: Contract, reports: Sequence[StepReport]
              ) -> list[Unmet]:
    if reports[p["step"]].status == "done":
        return []
    return [Unmet(p["step"], f"{p['what']}: got {reports[p['step']].status}, expected "
                             "admitted")]


def freed_by(reports: Sequence[StepReport], step: int) -> int:
    """The blocks the op at `step` gave back: the used blocks after the op before it,
    less those after it (negative when it took blocks)."""
    before = reports[step - 1].used_blocks if step else 0
    return before - reports[step].used_blocks


def _freed(p: Mapping[str, Any], contract: Contract, reports: Sequence[StepReport]
           ) -> list[Unmet]:
    got = freed_by(reports, p["step"])
    if got == p["want"]:
        return []
    return [Unmet(p["step"], f"{p['what']}: freed {got} blocks, expected {p['want']}")]


def _done(p: Mapping[str, Any], contract: Contract, reports: Sequence[StepReport]
          ) -> list[Unmet]:
    r = reports[p["step"]]
    if r.status != "skipped":
        return []
    return [Unmet(p["step"], f"{r.op.describe()} was skipped: {r.detail}")]


def _distinct_event_hashes(p: Mapping[str, Any], contract: Contract,
                           reports: Sequence[StepReport]) -> list[Unmet]:
    scopes = [(s["label"], Scope.from_dict(s["scope"]),
               first_stored_hash(reports[s["first"]:s["last"] + 1])) for s in p["scopes"]]
    known = contract.limited("scope_in_event_hash")  # kind -> upstream link
    same: list[str] = []
    limited: list[str] = []
    links: set[str] = set()
    for i, (x, sx, hx) in enumerate(scopes):
        for y, sy, hy in scopes[i + 1:]:
            kinds = _differ(sx, sy) & set(contract.scope_in_event_hash)
            if contract.scope_key(sx) == contract.scope_key(sy) or not kinds \
                    or hx is None or hx != hy:
                continue
            pair = f"{x} / {y} ({', '.join(sorted(kinds))})"
            if kinds <= set(known):
                limited.append(pair)
                links |= {known[k] for k in kinds}
            else:
                same.append(pair)
    last = max(s["last"] for s in p["scopes"])
    out = []
    if same:
        out.append(Unmet(last, f"router events: {len(same)} pairs of scopes that differ in "
                               "kinds the contract says reach event hashes publish one block "
                               f"0 hash: {_some(same)}"))
    if limited:
        link = ", ".join(sorted(links))
        out.append(Unmet(last, f"router events: {len(limited)} pairs of scopes that differ "
                               "only in a kind the engine leaves out of its event hashes, a "
                               f"known limitation ({link}), publish one block 0 hash: "
                               f"{_some(limited)}", link))
    return out


def _some(pairs: list[str]) -> str:
    return "; ".join(pairs[:4]) + (" ..." if len(pairs) > 4 else "")


def _preempted(p: Mapping[str, Any], contract: Contract, reports: Sequence[StepReport]
               ) -> list[Unmet]:
    got = list(reports[p["step"]].preempted)
    if got == p["want"]:
        return []
    return [Unmet(p["step"], f"{p['what']}: preempted {got!r}, expected {p['want']!r}")]


def _status(p: Mapping[str, Any], contract: Contract, reports: Sequence[StepReport]
            ) -> list[Unmet]:
    got = reports[p["step"]].status
    if got == p["want"]:
        return []
    return [Unmet(p["step"], f"{p['what']}: got {got}, expected {p['want']}")]


def scheduled_by(report: StepReport) -> int | None:
    """The tokens of its sequence scheduled after the op of `report`: an admission's
    scheduled_tokens, a reserve's value; None when it did not happen."""
    if report.status != "done":
        return None
    if report.op.kind == "admit":
        return int(report.value["scheduled_tokens"])
    return report.value if report.op.kind == "reserve" else None


def _scheduled(p: Mapping[str, Any], contract: Contract, reports: Sequence[StepReport]
               ) -> list[Unmet]:
    got = [scheduled_by(reports[s]) for s in p["steps"]]
    if got == p["want"]:
        return []
    return [Unmet(p["steps"][-1], f"{p['what']}: got {got!r}, expected {p['want']!r}")]


def event_hashes(reports: Sequence[StepReport], kind: str) -> list[str]:
    """The block hashes of every `kind` event in `reports`, in order."""
    return [str(h) for r in reports for e in r.events if e.get("type") == kind
            for h in e.get("block_hashes", ())]


def _evicted(p: Mapping[str, Any], contract: Contract, reports: Sequence[StepReport]
             ) -> list[Unmet]:
    stored = event_hashes(reports[p["first"]:p["last"] + 1], "BlockStored")
    want = sorted(stored if p["which"] == "all" else stored[-1:])
    got = sorted(event_hashes(reports[p["step"]:p["step"] + 1], "BlockRemoved"))
    if got == want:
        return []
    return [Unmet(p["step"], f"{p['what']}: removed {got!r}, expected {want!r}")]


def _event_fields(p: Mapping[str, Any], contract: Contract, reports: Sequence[StepReport]
                  ) -> list[Unmet]:
    fields: set[str] = set(contract.event_fields)
    wrong: list[str] = []
    for s in p["scopes"]:
        prompt = list(reports[s["first"]].op.tokens or ())
        stored = [e for r in reports[s["first"]:s["last"] + 1] for e in r.events
                  if e.get("type") == "BlockStored"]
        wrong += [f"{s['label']}: {w}" for w in field_problems(
            stored, fields, prompt, Scope.from_dict(s["scope"]) or Scope(),
            contract.block_size)]
    if not wrong:
        return []
    last = max(s["last"] for s in p["scopes"])
    return [Unmet(last, f"BlockStored fields: {_some(wrong)}")]


def field_problems(stored: list[dict[str, Any]], fields: set[str], prompt: list[int],
                   scope: Scope, block_size: int) -> list[str]:
    """What the `fields` of one cold prompt's BlockStored events (`stored`, in order,
    blocks of `block_size` tokens) get wrong, each a short sentence; [] when nothing."""
    size = block_size
    out: list[str] = []
    if not stored:
        return ["no BlockStored event"]
    at, parent = 0, None
    for e in stored:
        hashes = [str(h) for h in e["block_hashes"]]
        tokens = list(e.get("token_ids", ()))
        if "parent_block_hash" in fields and e.get("parent_block_hash") != parent:
            out.append(f"parent_block_hash {e.get('parent_block_hash')} after {parent}")
        if "token_ids" in fields and (tokens != prompt[at:at + len(tokens)]
                                      or not (len(hashes) - 1) * size < len(tokens)
                                      <= len(hashes) * size):
            out.append(f"token_ids {tokens} for {len(hashes)} blocks from token {at}")
        if "block_size" in fields and e.get("block_size") != size:
            out.append(f"block_size {e.get('block_size')}")
        for name, value in (("salt", scope.salt), ("lora_id", scope.lora_id),
                            ("lora_name", scope.lora_name)):
            if name in fields and e.get(name) != value:
                out.append(f"{name} {e.get(name)!r}, the scope's is {value!r}")
        if "medium" in fields and not (isinstance(e.get("medium"), str) and e["medium"]):
            out.append(f"medium {e.get('medium')!r}")
        if "group_idx" in fields and e.get("group_idx") not in (0, None):
            out.append(f"group_idx {e.get('group_idx')!r} for the full-attention group")
        if "extra_keys" in fields:
            out += _extra_key_problems(e.get("extra_keys"), len(hashes), at // size, scope)
        at += len(hashes) * size
        parent = hashes[-1]
    return out


def _extra_key_problems(extra: Any, num_blocks: int, first: int, scope: Scope) -> list[str]:
    """One entry per block; the salt in block 0's entry alone; the LoRA's name in
    every entry (vLLM's BlockStored: 'Each entry contains, in order, the LoRA name (if
    lora_name is set), ... the cache_salt string ...')."""
    if not isinstance(extra, list) or len(extra) != num_blocks:
        return [f"extra_keys {extra!r}: not one entry per block ({num_blocks})"]
    out = []
    for i, entry in enumerate(extra):
        values = _flat(entry)
        if scope.salt is not None and (scope.salt in values) != (first + i == 0):
            out.append(f"extra_keys of block {first + i}: {entry!r} (salt {scope.salt!r})")
        if scope.lora_name is not None and scope.lora_name not in values:
            out.append(f"extra_keys of block {first + i}: {entry!r} (LoRA "
                       f"{scope.lora_name!r})")
    return out


def _flat(entry: Any) -> list[Any]:
    if isinstance(entry, list):
        return [x for item in entry for x in _flat(item)]
    return [] if entry is None else [entry]


Judge = Callable[[Mapping[str, Any], Contract, Sequence[StepReport]], list[Unmet]]
EXPECTATIONS: dict[str, Judge] = {
    "result": _result, "admitted": _admitted, "done": _done, "freed": _freed,
    "distinct_event_hashes": _distinct_event_hashes, "preempted": _preempted,
    "status": _status, "scheduled": _scheduled, "evicted": _evicted,
    "event_fields": _event_fields}


def judge(expectations: Sequence[Expectation], contract: Contract,
          reports: Sequence[StepReport]) -> list[Unmet]:
    """Every expectation that did not hold on `reports` (the op list's step reports,
    under `contract`), in the order declared. Reads only."""
    return [u for e in expectations for u in EXPECTATIONS[e.name](e.params, contract, reports)]


# -- reading them from a file ---------------------------------------------------------------


def _step(value: Any, where: str, num_ops: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_ops:
        raise ValueError(f"{where} must be an op index, an int in [0, {num_ops}), got "
                         f"{value!r}")
    return value


def _label(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LABEL_CHARS:
        raise ValueError(f"{where} must be a str of 1 to {MAX_LABEL_CHARS} characters, got "
                         f"{str(value)[:60]!r}")
    return value


def _want(value: Any, where: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise ValueError(f"{where} must be an int >= 0 or null, got {value!r}")
    return value


def _scopes(value: Any, where: str, num_ops: int) -> list[dict[str, Any]]:
    if not isinstance(value, list) or len(value) < 2:
        raise ValueError(f"{where} must be a list of at least two scopes")
    out = []
    for i, s in enumerate(value):
        at = f"{where}[{i}]"
        s = check_keys(s, ("label", "scope", "first", "last"), at)
        Scope.from_dict(s.get("scope"), f"{at}.scope")
        first = _step(s.get("first"), f"{at}.first", num_ops)
        if _step(s.get("last"), f"{at}.last", num_ops) < first:
            raise ValueError(f"{at}.last must not be before {at}.first ({first})")
        out.append({"label": _label(s.get("label"), f"{at}.label"), "scope": s.get("scope"),
                    "first": first, "last": s["last"]})
    return out


def _names(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and 0 < len(v) <= 200
                                              for v in value):
        raise ValueError(f"{where} must be a list of sequence ids (str), got "
                         f"{str(value)[:60]!r}")
    return value


def _status_name(value: Any, where: str) -> str:
    if value not in get_args(Status):
        raise ValueError(f"{where} must be one of {', '.join(get_args(Status))}, got "
                         f"{str(value)[:60]!r}")
    return str(value)


def _steps(value: Any, where: str, num_ops: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of op indexes")
    return [_step(v, f"{where}[{i}]", num_ops) for i, v in enumerate(value)]


def _wants(value: Any, where: str) -> list[int | None]:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of ints >= 0 or null, got "
                         f"{str(value)[:60]!r}")
    return [_want(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _which(value: Any, where: str) -> str:
    if value not in ("all", "last"):
        raise ValueError(f"{where} must be 'all' or 'last', got {str(value)[:60]!r}")
    return str(value)


# name -> its parameters and how each is read (value, where, op count) -> value
_PARAMS: dict[str, dict[str, Callable[[Any, str, int], Any]]] = {
    "result": {"step": _step, "what": lambda v, w, n: _label(v, w),
               "want": lambda v, w, n: _want(v, w)},
    "admitted": {"step": _step, "what": lambda v, w, n: _label(v, w)},
    "done": {"step": _step},
    "freed": {"step": _step, "what": lambda v, w, n: _label(v, w),
              "want": lambda v, w, n: _want(v, w)},
    "distinct_event_hashes": {"scopes": _scopes},
    "preempted": {"step": _step, "what": lambda v, w, n: _label(v, w),
                  "want": lambda v, w, n: _names(v, w)},
    "status": {"step": _step, "what": lambda v, w, n: _label(v, w),
               "want": lambda v, w, n: _status_name(v, w)},
    "scheduled": {"steps": _steps, "what": lambda v, w, n: _label(v, w),
                  "want": lambda v, w, n: _wants(v, w)},
    "evicted": {"step": _step, "what": lambda v, w, n: _label(v, w), "first": _step,
                "last": _step, "which": lambda v, w, n: _which(v, w)},
    "event_fields": {"scopes": _scopes}}


def from_json(data: Any, where: str, num_ops: int) -> list[Expectation]:
    """Parse a list of `Expectation.as_dict()`s declared over an op list of `num_ops`
    ops; ValueError naming `where[i]` and the field (an unknown name lists the
    registered ones; a step outside the op list, a missing or unknown parameter, a
    value of the wrong type)."""
    if not isinstance(data, list):
        raise ValueError(f"{where}: expected a list of expectations, got "
                         f"{type(data).__name__}")
    out = []
    for i, item in enumerate(data):
        at = f"{where}[{i}]"
        item = check_keys(item, ("name", "params"), at)
        name = item.get("name")
        if name not in EXPECTATIONS:
            raise ValueError(f"{at}.name: {str(name)[:60]!r} is not a registered expectation; "
                             f"known: {', '.join(EXPECTATIONS)}")
        readers = _PARAMS[name]
        params = check_keys(item.get("params"), tuple(readers), f"{at}.params")
        missing = [k for k in readers if k not in params]
        if missing:
            raise ValueError(f"{at}.params: missing {', '.join(missing)}")
        out.append(Expectation(name, {k: read(params[k], f"{at}.params.{k}", num_ops)
                                      for k, read in readers.items()}))
    return out

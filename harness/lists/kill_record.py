"""The kill record: which tests killed which mutants, `test_lists/.test_kills.json`.

    {"mutants": {"<mutant id>": ["<node id of each test that killed it>", ...]}}

tools/mutants.py writes it (`write_kills`) after each mutant it runs; the plugin's
fail-first order reads it (`load_kills`, harness.plugin.ordering) to rank the tests by
new mutants killed per second. A mutant with an empty list survived every test run
against it. This module is the record's one home: its file name, its shape, its reader
and its writer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from harness.data_files import load_json

KILLS_NAME = ".test_kills.json"


def load_kills(path: Path) -> dict[str, frozenset[str]]:
    """Read a kill record: mutant id -> the node ids of the tests that killed it.

    Raises ValueError naming the file when it is missing, not JSON, nested too deep, or
    not `{"mutants": {"<id>": ["<node id>", ...]}}`; an empty list (a surviving mutant) is
    allowed. Mutates nothing.
    """
    data = load_json(path, "kill record")
    mutants = data.get("mutants") if isinstance(data, dict) else None
    if not isinstance(mutants, dict):
        raise ValueError(f'{path}: a kill record is {{"mutants": {{"<mutant id>": ["<node id>", '
                         f"...]}}}} (got {type(data).__name__} without a 'mutants' object)")
    for mutant, killers in mutants.items():
        if not isinstance(killers, list) or not all(isinstance(k, str) for k in killers):
            raise ValueError(f"{path}: mutant {mutant!r}: the tests that killed it are a list of "
                             f"node ids (got {killers!r})")
    return {str(m): frozenset(k) for m, k in mutants.items()}


def write_kills(path: Path, kills: Mapping[str, Iterable[str]]) -> None:
    """Write `kills` (mutant id -> killing node ids) as the kill record at `path`, in
    place of what it held: mutants and node ids sorted, each node id once, the folder
    made if missing. Whole or not at all: every pre-merge run reads this file, so it is
    written beside and then moved over the old one, and a run stopped mid-write leaves
    the old record (and a `.partial` file), never a truncated one. Raises OSError where
    the folder cannot be written."""
    record = {"mutants": {m: sorted(set(k)) for m, k in kills.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(partial, path)

"""The plugin's command-line options, in one `kvharness` group.

The plugin is loaded by its entry point into every pytest run of an environment that has
kvcache-harness installed, next to every other plugin and conftest there, so its options
must not take names others use: a second `--reruns` (pytest-rerunfailures') or `--gpu`
(a common conftest option) kills the run at start with argparse's "conflicting option
string", and a shared `dest` silently hands one plugin's value to the other. So every
option of the harness's own is `--kvh-<name>`, stored in `config.option.kvh_<name>`.

Three keep TensorRT-LLM's conftest spelling, because a command line written for its
runs is meant to work here: `--test-list`, `--waives-file`, `--test-prefix` (TRTLLM_OPTIONS;
their dests are `kvh_...` all the same). They are declared after the initial conftests
are loaded, and only where no conftest or plugin has declared them already: in a
TensorRT-LLM checkout its conftest owns them, the run starts, and the harness acts on none
of them (`yielded_options` names them; the header says so).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from harness.lists.entry import ORDERS
from harness.lists.hardware import MachineFlags, add_job_options, add_machine_options
from harness.lists.kill_record import KILLS_NAME
from harness.plugin.isolation import REPORT_OPTION

PREFIX = "--kvh-"
GROUP = "kvharness"
# TensorRT-LLM's conftest spellings: option string -> (dest, help).
TRTLLM_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "--test-list": ("kvh_test_list", {
        "metavar": "FILE", "help": "select tests from a plain list, one entry a line"}),
    "--waives-file": ("kvh_waives", {
        "metavar": "FILE", "help": "skip the tests waived in FILE (default with "
        "--kvh-test-db: DIR/../waives.txt when it exists)"}),
    "--test-prefix": ("kvh_test_prefix", {
        "metavar": "PREFIX", "help": "report test ids as PREFIX/<id> (a stage name such as "
        "H100-PyTorch-1); its first '-' part scopes full:<GPU>/ waives"}),
}
YIELDED = pytest.StashKey[tuple[str, ...]]()


def _group(parser: pytest.Parser) -> pytest.OptionGroup:
    return parser.getgroup(GROUP, "test lists, waives, isolation, reruns, shards and leak "
                           "checks (kvharness)")


def _prefixed(add: Callable[..., Any]) -> Callable[..., Any]:
    """`add`, declaring `--name` as `--kvh-name` with dest `kvh_name` (the machine flags,
    which the `kvharness` command line spells without the prefix)."""
    def add_prefixed(name: str, **attrs: Any) -> Any:
        bare = name.removeprefix("--")
        return add(PREFIX + bare, dest="kvh_" + bare.replace("-", "_"), **attrs)
    return add_prefixed


def add_options(parser: pytest.Parser) -> None:
    """Declare every `--kvh-` option on pytest's `parser` (TRTLLM_OPTIONS come later:
    `add_trtllm_options`)."""
    group = _group(parser)
    group.addoption("--kvh-test-db", metavar="DIR", default=None,
                    help="select tests from the YAML lists in DIR for this machine and stage")
    group.addoption("--kvh-context", metavar="NAME", default=None,
                    help="with --kvh-test-db: only the blocks of context NAME "
                    "(trt-test-db --context)")
    group.addoption("--kvh-list-order", action="store_true", default=False,
                    help="run the selected tests in the order of the list entries")
    group.addoption("--kvh-reruns", dest="kvh_reruns", action="store_true", default=None,
                    help="rerun failed tests by TensorRT-LLM's rule (default: as each list "
                    "block says; post_merge blocks do, pre_merge blocks do not); a test "
                    "pytest-rerunfailures reruns (--reruns, @flaky) is left to it")
    group.addoption("--kvh-no-reruns", dest="kvh_reruns", action="store_false",
                    help="never rerun a failed test")
    group.addoption("--kvh-changed-since", metavar="REF", default=None,
                    help="run only the selected tests whose sources changed since git REF "
                    "(and always_run blocks); the rest go to the not-run manifest")
    group.addoption("--kvh-shard", type=int, default=None, metavar="K",
                    help="run shard K (1-based) of a plan that spreads the selected tests "
                    "over shards by recorded durations: pytest-split's least_duration")
    group.addoption("--kvh-shards", type=int, default=None, metavar="N",
                    help="with --kvh-shard: split into N shards")
    group.addoption("--kvh-shard-time-budget", type=float, default=None, metavar="MINUTES",
                    help="with --kvh-shard: as many shards as keep each within MINUTES")
    group.addoption("--kvh-durations-file", metavar="FILE", default=None,
                    help="durations for --kvh-shard and --kvh-order (pytest-split JSON; "
                    "default with --kvh-test-db: DIR/../.test_durations)")
    group.addoption("--kvh-order", choices=ORDERS, default=None,
                    help="fail-first: run the selected tests cheapest-to-fail first, by kills "
                    "per second (kill record and durations); collection: as collected "
                    "(default: as each list block's `order:` says)")
    group.addoption("--kvh-kill-record", metavar="FILE", default=None,
                    help="which tests killed which mutants, for --kvh-order (default with "
                    f"--kvh-test-db: DIR/../{KILLS_NAME} when it exists)")
    add_machine_options(_prefixed(group.addoption))
    add_job_options(group.addoption, prefix="kvh-")
    group.addoption("--kvh-foreign-lists", action="store_true", default=False,
                    help="the lists and waives name another repository's tests (implied by "
                    "--test-prefix): entries and waives that match nothing are counted in the "
                    "summary line, not errors or warnings, and tests in no list are not sought")
    group.addoption("--kvh-results-dir", metavar="DIR", default=None,
                    help="write the reuse report, repro files and run record into DIR")
    group.addoption("--kvh-gpu-per-worker", action="store_true", default=False,
                    help="with pytest-xdist -n N: pin worker K to the K-th visible GPU")
    group.addoption(REPORT_OPTION, metavar="FILE", default=None, help=argparse.SUPPRESS)


def _declared(config: pytest.Config, option: str) -> bool:
    try:
        config.getoption(option)
    except ValueError:  # pytest's "no option named ..."
        return False
    return True


def add_trtllm_options(config: pytest.Config | None, parser: pytest.Parser) -> None:
    """Declare each of TRTLLM_OPTIONS that no conftest or plugin of `config` has declared
    (with a default, as TensorRT-LLM's conftest does) yet; the others are left to their
    owner, read as not given here and named by `yielded_options`. Without a config (the
    plugin loaded by a conftest, after the initial ones), declare them all. Mutates
    `parser`, and `config.option` and `config.stash` for those left."""
    group = _group(parser)
    yielded = []
    for option, (dest, attrs) in TRTLLM_OPTIONS.items():
        if config is not None and _declared(config, option):
            yielded.append(option)
            setattr(config.option, dest, None)
        else:
            group.addoption(option, dest=dest, default=None, **attrs)
    if config is not None:
        config.stash[YIELDED] = tuple(yielded)


def yielded_options(config: pytest.Config) -> tuple[str, ...]:
    """TensorRT-LLM's spellings that another plugin or conftest owns in this run."""
    return config.stash.get(YIELDED, ())


def machine_flags(config: pytest.Config) -> MachineFlags:
    """The machine flags' values, read from their `kvh_` dests."""
    opt = config.option
    values = {name: getattr(opt, "kvh_" + name) for name in MachineFlags._fields}
    values["job"] = tuple(values["job"] or ())  # an append option left unset is None
    return MachineFlags(**values)

"""The plugin's command-line options, in one `kvharness` group.

List options follow TensorRT-LLM's conftest spelling where it has one (`--test-list`,
`--waives-file`, `--test-prefix`) and `trt-test-db`'s (`--context`).
"""

from __future__ import annotations

import argparse

import pytest

from harness.lists.hardware import add_job_options, add_machine_options
from harness.plugin.isolation import REPORT_OPTION


def add_options(parser: pytest.Parser) -> None:
    """Declare every kvharness option on pytest's `parser`."""
    group = parser.getgroup("kvharness", "test lists, waives, isolation, reruns, shards and "
                            "leak checks (kvharness)")
    group.addoption("--test-db", metavar="DIR", default=None,
                    help="select tests from the YAML lists in DIR for this machine and stage")
    group.addoption("--context", metavar="NAME", default=None,
                    help="with --test-db: only the blocks of context NAME (trt-test-db --context)")
    group.addoption("--test-list", metavar="FILE", default=None,
                    help="select tests from a plain list, one entry a line")
    group.addoption("--waives", "--waives-file", dest="waives", metavar="FILE", default=None,
                    help="skip the tests waived in FILE (default with --test-db: "
                    "DIR/../waives.txt when it exists)")
    group.addoption("--test-prefix", metavar="PREFIX", default=None,
                    help="report test ids as PREFIX/<id> (a stage name such as "
                    "H100-PyTorch-1); its first '-' part scopes full:<GPU>/ waives")
    group.addoption("--list-order", action="store_true", default=False,
                    help="run the selected tests in the order of the list entries")
    group.addoption("--reruns", dest="reruns", action="store_true", default=None,
                    help="rerun failed tests by TensorRT-LLM's rule (default: as each list "
                    "block says; post_merge blocks do, pre_merge blocks do not)")
    group.addoption("--no-reruns", dest="reruns", action="store_false",
                    help="never rerun a failed test")
    group.addoption("--changed-since", metavar="REF", default=None,
                    help="run only the selected tests whose sources changed since git REF "
                    "(and always_run blocks); the rest go to the not-run manifest")
    group.addoption("--shard", type=int, default=None, metavar="K",
                    help="run shard K (1-based) of a plan that spreads the selected tests "
                    "over shards by recorded durations, longest first (LPT)")
    group.addoption("--shards", type=int, default=None, metavar="N",
                    help="with --shard: split into N shards")
    group.addoption("--shard-time-budget", type=float, default=None, metavar="MINUTES",
                    help="with --shard: as many shards as keep each within MINUTES")
    group.addoption("--durations-file", metavar="FILE", default=None,
                    help="durations for --shard (pytest-split JSON; default with --test-db: "
                    "DIR/../.test_durations)")
    add_machine_options(group.addoption)
    add_job_options(group.addoption, prefix="kvh-")
    group.addoption("--kvh-foreign-lists", action="store_true", default=False,
                    help="the lists and waives name another repository's tests (implied by "
                    "--test-prefix): entries and waives that match nothing are counted in the "
                    "summary line, not errors or warnings, and tests in no list are not sought")
    group.addoption("--results-dir", metavar="DIR", default=None,
                    help="write the reuse report, repro files and run record into DIR")
    group.addoption("--gpu-per-worker", action="store_true", default=False,
                    help="with pytest-xdist -n N: pin worker K to the K-th visible GPU")
    group.addoption(REPORT_OPTION, metavar="FILE", default=None, help=argparse.SUPPRESS)

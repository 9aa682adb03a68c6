"""`kvharness test-db` and `kvharness sysinfo`: TensorRT-LLM's `trt-test-db` render and
its get_sysinfo.py "Mako options", for its own files as for this repository's.

`trt-test-db -d DIR --context CTX --test-names --output FILE --match JSON` is not public;
what it does is read from how TensorRT-LLM's CI calls it and consumes its output
(test_lists/SCHEMA.md, "kvharness test-db"): a block applies when every key of its
condition holds for the JSON description (harness.lists.conditions), and the output is
every entry line of every applying block, markers kept, in file and block order. Under
`--match` (what TensorRT-LLM's CI passes) a condition key the JSON lacks or holds as null
is ignored; under `--match-exact` it fails the block.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from typing import Any

from harness.lists.db import ListDb
from harness.lists.hardware import Machine, unprintable

MAX_DESCRIPTION_CHARS = 1 << 16  # get_sysinfo's JSON is about 1 kB


def parse_description(text: str, flag: str) -> dict[str, Any]:
    """The machine and job description a `--match`/`--match-exact` JSON text gives: an
    object of strings, numbers, booleans and nulls (get_sysinfo's Mako options as
    TensorRT-LLM's Jenkins writes them: numbers as strings, `True` as true, `None` as
    null). Raises ValueError naming `flag` and what is wrong."""
    if len(text) > MAX_DESCRIPTION_CHARS:
        raise ValueError(f"{flag}: a description of {len(text)} characters; at most "
                         f"{MAX_DESCRIPTION_CHARS}")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{flag}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag}: the description is a JSON object of key: value, got "
                         f"{type(data).__name__}")
    bad = next(((k, v) for k, v in data.items() if isinstance(v, list | dict)), None)
    if bad is not None:
        raise ValueError(f"{flag}: {bad[0]!r} is {json.dumps(bad[1])[:60]}; a description's "
                         "values are strings, numbers, booleans or null")
    return data


def render(db: ListDb, description: Mapping[str, Any] | None, exact: bool) -> list[str]:
    """Every entry line (Entry.line) of every block of `db` whose condition holds for
    `description` (None: every block, as `trt-test-db` without a match renders), in file
    and block order, duplicates kept."""
    if description is None:
        return [e.line for e in db.entries]
    return [e.line for v in db.explain(description, exact) if v.selected for e in v.block.entries]


def _os_release(key: str) -> str:
    try:
        return platform.freedesktop_os_release().get(key, "na")
    except OSError:
        return "na"


def trtllm_gpu_name(gpu: str) -> str:
    """A GPU name as get_sysinfo.py writes it: upper case, without "NVIDIA"."""
    return gpu.replace("NVIDIA", "").strip().upper()


def sysinfo(machine: Machine) -> dict[str, Any]:
    """The description of `machine` in get_sysinfo.py's keys and order (those this
    harness knows: no memory sizes or library versions), then this harness's
    supports_bf16/supports_fp4, then the job: stage, orchestrator and the `--job` terms
    (as get_sysinfo's `--mako-opt` appends them)."""
    features = machine.features
    capability = machine.compute_capability
    return {
        "gpu": trtllm_gpu_name(machine.gpu),
        "hostname": platform.node(),
        "is_aarch64": machine.cpu_arch == "aarch64",
        "is_linux": platform.system() == "Linux",
        "system_gpu_count": machine.gpu_count,
        "linux_distribution_name": machine.distribution,
        "linux_version": _os_release("VERSION_ID"),
        "linux_codename": _os_release("VERSION_CODENAME"),
        "compute_capability": None if capability is None else float(capability),
        "supports_tf32": features["supports_tf32"],
        "supports_int8": features["supports_int8"],
        "supports_fp8": features["supports_fp8"],
        "supports_bf16": features["supports_bf16"],
        "supports_fp4": features["supports_fp4"],
        "cpu": machine.cpu_arch,
        "sysname": platform.system(),
        "stage": machine.stage,
        "orchestrator": machine.orchestrator,
        **dict(machine.job),
    }


def mako_lines(info: Mapping[str, Any]) -> list[str]:
    """get_sysinfo.py's printout: `Mako options:` then `key=value` lines, values as
    Python prints them (True, None, 9.0). Raises ValueError naming the key when a key or
    value holds a control character: it would print a line, an option, of its own (the
    flags refuse them too; this covers what the system reports: host name, os-release)."""
    for key, value in info.items():
        problem = unprintable("key", str(key)) or unprintable(str(key), str(value))
        if problem is not None:
            raise ValueError(f"sysinfo: {problem}")
    return ["Mako options:", *(f"{key}={value}" for key, value in info.items())]

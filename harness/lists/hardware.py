"""What this machine is, and the machine description that test lists select by.

`detect()` looks at the hardware (GPU kind, count and compute capability through torch,
FlashInfer, CPU architecture, Linux distribution); `machine_from_options()` turns the
shared flags (`--stage --gpu --gpu-count --backend --orchestrator`, used by both the
pytest plugin and `kvharness list`) into a `Machine`, filling what a flag leaves open
from detection. A GPU named with `--gpu` on a machine without it is *pretended*: it
brings the backends and capability such a machine has, so the lists select what they
would there (its GPU tests still skip for want of CUDA).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple, cast, get_args

from harness.lists.gpus import FEATURES, capability_of, features_of

Stage = Literal["pre_merge", "post_merge"]
Backend = Literal["torch", "flashinfer"]
# TensorRT-LLM's test-db term; this project launches no ranks itself, so the value is
# what `--orchestrator` says (TensorRT-LLM's default, mpi, unless told otherwise).
Orchestrator = Literal["mpi", "ray"]
STAGES: tuple[Stage, ...] = get_args(Stage)
BACKENDS: tuple[Backend, ...] = get_args(Backend)
ORCHESTRATORS: tuple[Orchestrator, ...] = get_args(Orchestrator)

# Description keys a machine's own flags set; a job term may not name them.
HARNESS_KEYS = ("stage", "orchestrator", "attention_backend", "gpu", "system_gpu_count",
                "linux_distribution_name", "cpu", "compute_capability", *FEATURES)

# A machine without CUDA is gpu "cpu" with gpu count 0 (the l0_cpu context selects it).
CPU_GPU_NAME = "cpu"


def _distribution() -> str:
    """The Linux distribution's ID ("ubuntu", "debian", "rhel"), else the OS name."""
    try:
        return platform.freedesktop_os_release().get("ID", "linux").lower()
    except OSError:  # not Linux, or no os-release file
        return platform.system().lower() or "unknown"


@dataclass(frozen=True)
class Hardware:
    """What `detect()` found: GPU name ("cpu" without CUDA), count, CUDA, FlashInfer, CPU
    architecture, distribution, and the first GPU's compute capability ("9.0")."""

    gpu: str
    gpu_count: int
    cuda: bool
    flashinfer: bool
    cpu_arch: str
    distribution: str = "unknown"
    compute_capability: str | None = None

    @property
    def backends(self) -> tuple[Backend, ...]:
        """Attention backends that can run here: torch always, flashinfer with CUDA."""
        return ("torch", "flashinfer") if self.flashinfer else ("torch",)


@dataclass(frozen=True)
class Machine:
    """A machine description as the lists see it: what conditions are matched against.

    `backends` is the set of attention backends this run may use: a block with
    `attention_backend: X` applies when X is among them (all usable ones by default, one
    with `--backend`). `job` holds the job's other terms (`backend=pytorch`,
    `auto_trigger=others`: `--job KEY=VALUE`), matched by blocks' terms of those names.
    `pretended` is True when `--gpu` named a GPU this machine does not have.
    """

    stage: Stage
    gpu: str
    gpu_count: int
    backends: tuple[Backend, ...]
    cuda: bool
    cpu_arch: str
    distribution: str = "unknown"
    compute_capability: str | None = None
    orchestrator: Orchestrator = "mpi"
    pretended: bool = False
    job: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        reserved = [k for k, _ in self.job if k in HARNESS_KEYS]
        if reserved:
            raise ValueError(f"job term {reserved[0]!r} is the machine's; its flag sets it "
                             f"(--{reserved[0].replace('_', '-')})")
        if self.stage not in STAGES:
            raise ValueError(f"stage {self.stage!r} is not one of {', '.join(STAGES)}")
        if not self.gpu.strip():
            raise ValueError("gpu name is empty; a machine without a GPU is gpu 'cpu'")
        if self.gpu_count < 0:
            raise ValueError(f"gpu count {self.gpu_count} is negative")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown or not self.backends:
            raise ValueError(f"backends {self.backends!r}: expected some of {', '.join(BACKENDS)}")
        if self.orchestrator not in ORCHESTRATORS:
            raise ValueError(f"orchestrator {self.orchestrator!r} is not one of "
                             f"{', '.join(ORCHESTRATORS)}")
        features_of(self.compute_capability)  # raises for a malformed capability

    @property
    def features(self) -> dict[str, bool]:
        """supports_<feature> -> bool, from the compute capability (gpus.features_of)."""
        return features_of(self.compute_capability)

    def description(self) -> dict[str, Any]:
        """What the lists' conditions are matched against (harness.lists.conditions), in
        TensorRT-LLM's sysinfo keys: gpu, system_gpu_count, linux_distribution_name, cpu,
        compute_capability (None without a GPU), supports_*, then the job: stage,
        orchestrator, attention_backend (the usable backends, a list) and `job`'s terms."""
        return {"gpu": self.gpu, "system_gpu_count": self.gpu_count,
                "linux_distribution_name": self.distribution, "cpu": self.cpu_arch,
                "compute_capability": self.compute_capability, **self.features,
                "stage": self.stage, "orchestrator": self.orchestrator,
                "attention_backend": list(self.backends), **dict(self.job)}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples become lists)."""
        data = asdict(self)
        data["backends"] = list(self.backends)
        data["job"] = [list(pair) for pair in self.job]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        """Inverse of `as_dict`; keys after `cpu_arch` may be missing (their defaults).
        Raises ValueError (via __post_init__) on bad values, KeyError on a missing key."""
        capability = data.get("compute_capability")
        return cls(
            stage=cast(Stage, data["stage"]),
            gpu=str(data["gpu"]),
            gpu_count=int(data["gpu_count"]),
            backends=tuple(cast(Backend, b) for b in data["backends"]),
            cuda=bool(data["cuda"]),
            cpu_arch=str(data["cpu_arch"]),
            distribution=str(data.get("distribution", "unknown")),
            compute_capability=None if capability is None else str(capability),
            orchestrator=cast(Orchestrator, data.get("orchestrator", "mpi")),
            pretended=bool(data.get("pretended", False)),
            job=tuple((str(k), str(v)) for k, v in data.get("job", ())),
        )

    def describe(self) -> str:
        """One line for headers and messages."""
        gpu = f"{self.gpu!r}" + (" (pretended)" if self.pretended else "")
        cc = f" cc={self.compute_capability}" if self.compute_capability else ""
        job = "".join(f" {k}={v}" for k, v in self.job)
        return (
            f"stage={self.stage} gpu={gpu} gpu_count={self.gpu_count}{cc} "
            f"backends={','.join(self.backends)} cuda={'yes' if self.cuda else 'no'}{job}"
        )


# Where a GPU's kernel driver shows on Linux: NVIDIA's, AMD's (a ROCm build of torch
# answers torch.cuda for it) and WSL's. Without any of them torch.cuda cannot be available.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd",
                    "/dev/dxg")


def detect(driver_paths: tuple[str, ...] = GPU_DRIVER_PATHS) -> Hardware:
    """Detect this machine. Imports torch (and flashinfer only where CUDA is available),
    except on Linux without any of `driver_paths`: no GPU driver, so no CUDA, known
    without torch's import (a second or more in every pytest process that selects by the
    lists, an xdist controller's included).

    Without torch or without CUDA the machine is gpu "cpu" with count 0. FlashInfer counts
    as usable when CUDA is available and `flashinfer` imports.
    """
    cpu = {"cpu_arch": platform.machine() or "unknown", "distribution": _distribution()}
    no_driver = platform.system() == "Linux" and not any(map(os.path.exists, driver_paths))
    if no_driver or importlib.util.find_spec("torch") is None:
        return Hardware(CPU_GPU_NAME, 0, cuda=False, flashinfer=False, **cpu)
    import torch

    if not torch.cuda.is_available():
        return Hardware(CPU_GPU_NAME, 0, cuda=False, flashinfer=False, **cpu)
    name = str(torch.cuda.get_device_name(0))
    count = int(torch.cuda.device_count())
    major, minor = torch.cuda.get_device_capability(0)
    return Hardware(name, count, cuda=True, flashinfer=_flashinfer_imports(),
                    compute_capability=f"{major}.{minor}", **cpu)


def _flashinfer_imports() -> bool:
    if importlib.util.find_spec("flashinfer") is None:
        return False
    try:
        importlib.import_module("flashinfer")
    except ImportError:
        # Installed but unusable (e.g. built for another CUDA): report it as absent.
        return False
    return True


def _gpu_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"gpu count {text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"gpu count {value} is negative")
    return value


# What breaks a `key=value` line: C0 and C1 controls (newline, carriage return, NEL) and
# Unicode's line and paragraph separators (str.splitlines breaks at each of them).
_LINE_BREAKING = ("Cc", "Zl", "Zp")


def unprintable(what: str, text: str) -> str | None:
    """Why `text`, the value of `what`, cannot be printed on one line (its first control
    character), or None when it can."""
    bad = next((ch for ch in text if unicodedata.category(ch) in _LINE_BREAKING), None)
    if bad is None:
        return None
    return (f"{what} {text!r} holds a control character (U+{ord(bad):04X}); a value is "
            "printed on one line")


def _gpu_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("gpu name is empty; a machine without a GPU is 'cpu'")
    problem = unprintable("gpu name", text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


class MachineFlags(NamedTuple):
    """The machine flags' values (None: detect; `job`: KEY=VALUE texts)."""

    stage: str = "pre_merge"
    gpu: str | None = None
    gpu_count: int | None = None
    backend: str | None = None
    orchestrator: str = "mpi"
    distribution: str | None = None
    job: tuple[str, ...] = ()

    @classmethod
    def of(cls, namespace: Any) -> MachineFlags:
        """Read the flags from the `kvharness` command's argparse namespace (a flag the
        namespace lacks keeps its default; pytest's are read by the plugin's
        `machine_flags`, from their `kvh_` dests)."""
        values: dict[str, Any] = {name: getattr(namespace, name, cls._field_defaults.get(name))
                                  for name in cls._fields}
        values["job"] = tuple(values["job"] or ())
        return cls(**values)

    def argv(self) -> list[str]:
        """The flags that were given, as a command line repeats them (for hints)."""
        out = ["--stage", self.stage]
        out += ["--gpu", self.gpu] if self.gpu is not None else []
        out += ["--gpu-count", str(self.gpu_count)] if self.gpu_count is not None else []
        out += ["--backend", self.backend] if self.backend is not None else []
        out += ["--orchestrator", self.orchestrator] if self.orchestrator != "mpi" else []
        out += ["--distribution", self.distribution] if self.distribution is not None else []
        for pair in self.job:
            out += ["--job", pair]
        return out


def add_machine_options(add: Callable[..., Any]) -> None:
    """Declare the MachineFlags options through `add` (argparse or pytest)."""
    add("--stage", choices=STAGES, default="pre_merge",
        help="pipeline stage whose blocks apply (default: pre_merge)")
    add("--gpu", type=_gpu_name, default=None, metavar="NAME",
        help="GPU name matched by the lists' gpu wildcards (default: detected; 'cpu' without "
        "CUDA); a GPU this machine lacks is pretended, with the backends it would have")
    add("--gpu-count", type=_gpu_count, default=None, metavar="N",
        help="GPU count matched by system_gpu_count ranges (default: detected, at least 1 "
        "for a pretended GPU)")
    add("--backend", choices=BACKENDS, default=None,
        help="restrict to one attention backend (default: every backend usable here)")
    add("--orchestrator", choices=ORCHESTRATORS, default="mpi",
        help="the value of TensorRT-LLM's orchestrator term (default: mpi)")


def _distribution_name(text: str) -> str:
    if not text.strip() or any(ch.isspace() for ch in text):
        raise argparse.ArgumentTypeError(f"distribution {text!r}: one word, as /etc/os-release's "
                                         "ID (ubuntu, debian, rhel)")
    return text.lower()


def job_term(text: str) -> tuple[str, str]:
    """`KEY=VALUE` as a job term (backend=pytorch); raises argparse.ArgumentTypeError
    for a missing `=`, an empty key or value, a control character (a line break would
    print a `sysinfo` line of its own), or a key the machine's own flags set (stage,
    orchestrator, gpu, ...)."""
    problem = unprintable("job term", text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not key or not value:
        raise argparse.ArgumentTypeError(f"job term {text!r} is not KEY=VALUE "
                                         "(backend=pytorch, auto_trigger=others)")
    if key in HARNESS_KEYS:
        raise argparse.ArgumentTypeError(f"job term {key!r} is the machine's; its flag sets it "
                                         f"(--{key.replace('_', '-')})")
    return key, value


def _job_text(text: str) -> str:
    job_term(text)
    return text


def add_job_options(add: Callable[..., Any], prefix: str = "") -> None:
    """Declare the distribution override and the job terms through `add` (argparse, or
    pytest with `prefix="kvh-"`), into MachineFlags' `distribution` and `job` (with the
    prefix: `kvh_distribution`, `kvh_job`)."""
    dest = prefix.replace("-", "_")
    add(f"--{prefix}distribution", dest=f"{dest}distribution", type=_distribution_name,
        default=None,
        metavar="ID", help="Linux distribution matched by linux_distribution_name wildcards "
        "(default: /etc/os-release's ID), e.g. ubuntu to run TensorRT-LLM's lists elsewhere")
    add(f"--{prefix}job", dest=f"{dest}job", type=_job_text, action="append", default=None,
        metavar="KEY=VALUE", help="a term of the job that blocks' terms of that name match "
        "(TensorRT-LLM's backend=pytorch, auto_trigger=others); repeatable")


def machine_from_options(flags: MachineFlags, hardware: Hardware) -> Machine:
    """The machine description from flag values; what a flag leaves None comes from
    `hardware`, or, for a pretended GPU, from what such a machine has.

    Raises ValueError for a stage, backend or orchestrator outside the closed sets.
    """
    if flags.backend is not None and flags.backend not in BACKENDS:
        raise ValueError(f"backend {flags.backend!r} is not one of {', '.join(BACKENDS)}")
    pretended = flags.gpu is not None and flags.gpu.lower() != hardware.gpu.lower()
    if not pretended:
        gpu, backends, capability = hardware.gpu, hardware.backends, hardware.compute_capability
        count = hardware.gpu_count
    elif flags.gpu is not None and flags.gpu.lower() == CPU_GPU_NAME:
        gpu, backends, capability, count = CPU_GPU_NAME, ("torch",), None, 0
    else:
        assert flags.gpu is not None
        gpu, capability = flags.gpu, capability_of(flags.gpu)
        backends, count = BACKENDS, max(hardware.gpu_count, 1)
    return Machine(
        stage=cast(Stage, flags.stage),
        gpu=gpu,
        gpu_count=count if flags.gpu_count is None else flags.gpu_count,
        backends=backends if flags.backend is None else (flags.backend,),
        cuda=hardware.cuda,
        cpu_arch=hardware.cpu_arch,
        compute_capability=capability,
        orchestrator=cast(Orchestrator, flags.orchestrator),
        distribution=hardware.distribution if flags.distribution is None else flags.distribution,
        pretended=pretended,
        job=tuple(job_term(pair) for pair in flags.job),
    )

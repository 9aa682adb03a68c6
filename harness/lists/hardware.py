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
import platform
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple, cast, get_args

from harness.lists.gpus import capability_of, features_of

Stage = Literal["pre_merge", "post_merge"]
Backend = Literal["torch", "flashinfer"]
# TensorRT-LLM's test-db term; this project launches no ranks itself, so the value is
# what `--orchestrator` says (TensorRT-LLM's default, mpi, unless told otherwise).
Orchestrator = Literal["mpi", "ray"]
STAGES: tuple[Stage, ...] = get_args(Stage)
BACKENDS: tuple[Backend, ...] = get_args(Backend)
ORCHESTRATORS: tuple[Orchestrator, ...] = get_args(Orchestrator)

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

    `backends` is the set of backends this run may use: a block with `backend: X`
    applies when X is among them (all usable ones by default, one with `--backend`).
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

    def __post_init__(self) -> None:
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

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples become lists)."""
        data = asdict(self)
        data["backends"] = list(self.backends)
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
        )

    def describe(self) -> str:
        """One line for headers and messages."""
        gpu = f"{self.gpu!r}" + (" (pretended)" if self.pretended else "")
        cc = f" cc={self.compute_capability}" if self.compute_capability else ""
        return (
            f"stage={self.stage} gpu={gpu} gpu_count={self.gpu_count}{cc} "
            f"backends={','.join(self.backends)} cuda={'yes' if self.cuda else 'no'}"
        )


def detect() -> Hardware:
    """Detect this machine. Imports torch (and flashinfer only where CUDA is available).

    Without torch or without CUDA the machine is gpu "cpu" with count 0. FlashInfer counts
    as usable when CUDA is available and `flashinfer` imports.
    """
    cpu = {"cpu_arch": platform.machine() or "unknown", "distribution": _distribution()}
    if importlib.util.find_spec("torch") is None:
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


def _gpu_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("gpu name is empty; a machine without a GPU is 'cpu'")
    return text


class MachineFlags(NamedTuple):
    """The machine flags' values (None: detect)."""

    stage: str = "pre_merge"
    gpu: str | None = None
    gpu_count: int | None = None
    backend: str | None = None
    orchestrator: str = "mpi"

    @classmethod
    def of(cls, namespace: Any) -> MachineFlags:
        """Read the flags from an argparse namespace or pytest's `config.option`."""
        return cls(*(getattr(namespace, name) for name in cls._fields))

    def argv(self) -> list[str]:
        """The flags that were given, as a command line repeats them (for hints)."""
        out = ["--stage", self.stage]
        out += ["--gpu", self.gpu] if self.gpu is not None else []
        out += ["--gpu-count", str(self.gpu_count)] if self.gpu_count is not None else []
        out += ["--backend", self.backend] if self.backend is not None else []
        out += ["--orchestrator", self.orchestrator] if self.orchestrator != "mpi" else []
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
        distribution=hardware.distribution,
        compute_capability=capability,
        orchestrator=cast(Orchestrator, flags.orchestrator),
        pretended=pretended,
    )

"""GPU kinds by name: their compute capability, and the features a capability implies.

Detection reads the capability from CUDA; a machine pretended with `--gpu NAME` (to see
what a GPU runner would select) gets it from `capability_of(NAME)`. The features are
TensorRT-LLM's test-db terms (`supports_fp8: true`), derived as TensorRT-LLM's own
skips derive them (FP8 from SM 8.9, FP4 from SM 10.0).
"""

from __future__ import annotations

import re

# (name words, capability): matched as whole words of the lower-cased GPU name, in order
# (GB200 before B200, GH200 before H200, so a longer name is never taken for a shorter).
_KNOWN: tuple[tuple[str, str], ...] = (
    ("gb300", "10.3"), ("b300", "10.3"),
    ("gb200", "10.0"), ("b200", "10.0"), ("b100", "10.0"),
    ("gb10", "12.1"), ("rtx pro 6000", "12.0"), ("rtx 5090", "12.0"), ("rtx 5080", "12.0"),
    ("gh200", "9.0"), ("h200", "9.0"), ("h100", "9.0"), ("h800", "9.0"), ("h20", "9.0"),
    ("l40s", "8.9"), ("l40", "8.9"), ("l4", "8.9"), ("rtx 6000 ada", "8.9"), ("rtx 4090", "8.9"),
    ("a100", "8.0"), ("a800", "8.0"), ("a30", "8.0"),
    ("a10", "8.6"), ("a10g", "8.6"), ("a40", "8.6"), ("rtx a6000", "8.6"), ("rtx 3090", "8.6"),
    ("t4", "7.5"), ("v100", "7.0"),
)

# supports_<feature>: the lowest SM that has it.
FEATURE_MIN_SM: dict[str, int] = {
    "supports_int8": 61,
    "supports_tf32": 80,
    "supports_bf16": 80,
    "supports_fp8": 89,
    "supports_fp4": 100,
}
FEATURES: tuple[str, ...] = tuple(FEATURE_MIN_SM)


def _words(name: str) -> str:
    return " " + re.sub(r"[^a-z0-9]+", " ", name.lower()).strip() + " "


def capability_of(gpu_name: str) -> str | None:
    """The compute capability ("9.0") of a GPU kind named like `gpu_name`
    ("NVIDIA H100 80GB HBM3", "h100", "H100_PCIe"), or None for a kind not in the table."""
    words = _words(gpu_name)
    return next((cc for kind, cc in _KNOWN if f" {kind} " in words), None)


def features_of(capability: str | None) -> dict[str, bool]:
    """supports_<feature> -> bool for a compute capability (all False without one).

    Raises ValueError for a capability that is not `<major>.<minor>`.
    """
    if capability is None:
        return dict.fromkeys(FEATURES, False)
    match = re.fullmatch(r"([0-9]{1,2})\.([0-9])", capability)  # ASCII: \d reads any script
    if match is None:
        raise ValueError(f"compute capability {capability!r} is not <major>.<minor>, e.g. 9.0")
    sm = int(match[1]) * 10 + int(match[2])
    return {name: sm >= low for name, low in FEATURE_MIN_SM.items()}

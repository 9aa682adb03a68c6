"""pytest plugin: markers and GPU skips (selection and leak checks grow here)."""

from __future__ import annotations

import pytest

MARKERS = {
    "gpu": "needs a CUDA device; skipped with a reason where there is none",
    "cuda_graph": "exercises CUDA-graph capture or replay",
    "flashinfer": "exercises the FlashInfer backend",
    "slow": "takes more than a few seconds on a 2-core CPU",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)

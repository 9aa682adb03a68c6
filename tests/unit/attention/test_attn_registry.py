"""The backend registry, and that importing it leaves flashinfer alone."""

from __future__ import annotations

import inspect
import sys

import pytest

from kvcache.attention import (
    AttentionBackend,
    FlashInferBackend,
    ReferenceBackend,
    StarAttentionBackend,
    backend_names,
    get_backend,
)
from kvcache.attention.base import BackendOptions
from tests.hang_guard import run_child


def test_registered_backends() -> None:
    assert backend_names() == ("flashinfer", "star", "torch")
    assert get_backend("torch") is ReferenceBackend
    assert get_backend("flashinfer") is FlashInferBackend
    assert get_backend("star") is StarAttentionBackend
    for name in backend_names():
        assert get_backend(name).name == name


def test_unknown_backend_lists_the_supported_names() -> None:
    with pytest.raises(ValueError, match="'flash'; supported: flashinfer, star, torch"):
        get_backend("flash")


def test_import_does_not_import_flashinfer() -> None:
    code = ("import sys, kvcache.attention; "
            "assert 'flashinfer' not in sys.modules, sorted(m for m in sys.modules "
            "if m.startswith('flashinfer'))")
    done = run_child([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr


def test_backend_options_mirror_the_base_constructor() -> None:
    # Subclasses take **BackendOptions; a parameter added to one but not the other drifts.
    params = set(inspect.signature(AttentionBackend.__init__).parameters) - {"self"}
    assert set(BackendOptions.__annotations__) == params

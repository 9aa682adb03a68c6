"""The environment a GPU run depends on, and one decode plan: the first thing to fail
when torch, CUDA, nvcc or FlashInfer do not fit together (FlashInfer compiles its
kernels on first use, with nvcc, unless a prebuilt kernel cache is installed)."""

from __future__ import annotations

import importlib
import importlib.metadata
import shutil

import pytest
import torch

from kvcache.attention.flashinfer.backend import flashinfer_version
from tests.gpu.support import TOL, Measure, backends, compare_step, make_pair

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer]


def test_environment_and_one_decode_plan(measure: Measure) -> None:
    fi_module = importlib.import_module("flashinfer")
    major, minor = torch.cuda.get_device_capability()
    measure.note("environment", {
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "flashinfer": flashinfer_version(fi_module), "gpu": torch.cuda.get_device_name(),
        "capability": f"{major}.{minor}", "nvcc": shutil.which("nvcc")})
    requests = [(21, 1), (0, 1), (40, 1)]
    pair = make_pair([c + n for c, n in requests], "NHD", torch.float16, num_layers=1)
    fi, ref = backends(pair, 16, num_qo_heads=4)  # the CUDA-core decode kernel
    compare_step(measure, pair, pair.metadata(requests, 16), fi, ref, layer=0,
                 dtype=torch.float16, seed=0, tol=TOL[torch.float16], what="decode")
    assert fi.kernels.decode == "cuda-cores"

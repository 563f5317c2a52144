"""Kernel tests run each Triton kernel against its torch reference: on the GPU in bf16 (``gpu`` marker) and, where
no GPU is visible, in Triton's interpreter on the CPU in float32 (so CI checks the kernels' logic too)."""
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before their import


@pytest.fixture(params=["interpret", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    """(device, dtype, relative tolerance) for one kernel run; fresh seed per test."""
    pytest.importorskip("triton")
    if request.param == "interpret" and torch.cuda.is_available():
        pytest.skip("kernels are compiled, not interpreted, where a GPU is visible")
    torch.manual_seed(zlib.crc32(request.node.name.encode()))
    return ("cpu", torch.float32, 1e-5) if request.param == "interpret" else ("cuda", torch.bfloat16, 1e-2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm()).item()

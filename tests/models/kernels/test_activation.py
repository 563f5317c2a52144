import torch

from blink.models.kernels import reference
from conftest import rel_err


def test_silu_and_mul(backend):
    device, dtype, tol = backend
    x = torch.randn(13, 2 * 1500, device=device, dtype=dtype) * 3
    from blink.models.kernels.activation import silu_and_mul

    assert rel_err(silu_and_mul(x), reference.silu_and_mul(x)) < tol

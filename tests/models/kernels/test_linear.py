"""A model-dtype projection's path by rows (``linear``): the skinny GEMM up to ``SKINNY_UP_TO`` rows, cuBLAS
(``F.linear``) beyond; both against float64."""
import torch
import torch.nn.functional as F

from tests.models.kernels.conftest import rel_err


def test_linear_takes_the_skinny_gemm_only_for_decode_sized_steps(backend):
    device, dtype, tol = backend
    from blink.models.kernels.linear import SKINNY_UP_TO, linear
    from blink.models.kernels.skinny import skinny_linear

    weight = torch.randn(192, 256, device=device, dtype=dtype) * 256 ** -0.5
    small, large = (torch.randn(t, 256, device=device, dtype=dtype) for t in (SKINNY_UP_TO, SKINNY_UP_TO + 1))
    assert torch.equal(linear(small, weight), skinny_linear(small, weight))
    assert torch.equal(linear(large, weight), F.linear(large, weight))
    for x in (small, large):
        assert rel_err(linear(x, weight), x.double() @ weight.double().T) < tol

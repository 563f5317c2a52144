"""A model-dtype projection's path by rows (``linear``): the skinny GEMM up to ``SKINNY_UP_TO`` rows, the rowwise TMA
GEMM up to ``ROWWISE_UP_TO``, cuBLAS (``F.linear``) beyond; each against float64."""
import pytest
import torch
import torch.nn.functional as F

from tests.models.kernels.conftest import rel_err


def test_linear_takes_the_skinny_gemm_then_the_rowwise_one_for_decode_sized_steps(backend):
    device, dtype, tol = backend
    from blink.models.kernels.rowwise import rowwise_linear
    from blink.models.kernels.linear import ROWWISE_UP_TO, SKINNY_UP_TO, linear
    from blink.models.kernels.skinny import skinny_linear

    weight = torch.randn(192, 256, device=device, dtype=dtype) * 256 ** -0.5
    small, middle, large = (torch.randn(t, 256, device=device, dtype=dtype)
                            for t in (SKINNY_UP_TO, SKINNY_UP_TO + 1, ROWWISE_UP_TO + 1))
    assert torch.equal(linear(small, weight), skinny_linear(small, weight))
    assert torch.equal(linear(middle, weight), rowwise_linear(middle, weight))
    assert torch.equal(linear(large, weight), F.linear(large, weight))
    strided = torch.randn(SKINNY_UP_TO + 1, 512, device=device, dtype=dtype)[:, ::2]  # TMA cannot read it
    assert torch.equal(linear(strided, weight), F.linear(strided, weight))
    for x in (small, middle, large, strided):
        assert rel_err(linear(x, weight), x.double() @ weight.double().T) < tol


@pytest.mark.parametrize("tokens, n, k", [(17, 96, 256), (33, 130, 512), (64, 192, 320)])
def test_rowwise_linear_matches_float64(backend, tokens, n, k):
    """Model-dtype operands through the TMA GEMM: token tiles mostly past the rows, an N that is no whole number of
    weight tiles, a K that is no whole number of stages."""
    device, dtype, tol = backend
    from blink.models.kernels.rowwise import rowwise_linear

    weight = torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
    x = torch.randn(tokens, k, device=device, dtype=dtype)
    out = rowwise_linear(x, weight)
    assert out.dtype == dtype and out.shape == (tokens, n)
    assert rel_err(out, x.double() @ weight.double().T) < tol

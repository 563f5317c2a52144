"""The skinny decode GEMM (``skinny``) with model-dtype weights against float64; its FP8 weights are tested in
``test_fp8.py``. K of 320 is not a whole number of ``block_k`` steps nor of split parts; 160 outputs are not a whole
number of tiles."""
import pytest
import torch

from tests.models.kernels.conftest import rel_err


@pytest.mark.parametrize("tokens", [1, 7, 16, 64])
@pytest.mark.parametrize("tiles", [None, dict(block_n=16, block_k=128, split_k=3), dict(block_n=64, block_k=64)])
def test_skinny_linear_of_model_dtype_weights_matches_float64(backend, tokens, tiles):
    device, dtype, tol = backend
    from blink.models.kernels.skinny import SkinnyTiles, skinny_linear

    weight = torch.randn(160, 320, device=device, dtype=dtype) * 320 ** -0.5
    x = torch.randn(tokens, 320, device=device, dtype=dtype)
    out = skinny_linear(x, weight, tiles=tiles and SkinnyTiles(**tiles))
    assert out.dtype == dtype and out.shape == (tokens, 160)
    assert rel_err(out, x.double() @ weight.double().T) < tol


def test_skinny_linear_reads_strided_rows(backend):
    """A step's activations may be a row-strided view (a slice of a wider buffer)."""
    device, dtype, tol = backend
    from blink.models.kernels.skinny import skinny_linear

    weight = torch.randn(96, 128, device=device, dtype=dtype)
    wide = torch.randn(5, 256, device=device, dtype=dtype)
    x = wide[:, 64:192]
    assert rel_err(skinny_linear(x, weight), x.double() @ weight.double().T) < tol


def test_skinny_linear_refuses_what_it_cannot_compute(backend):
    device, dtype, _ = backend
    from blink.models.kernels.skinny import SKINNY_MAX_TOKENS, skinny_linear

    weight = torch.randn(96, 128, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(torch.randn(SKINNY_MAX_TOKENS + 1, 128, device=device, dtype=dtype), weight)
    with pytest.raises(ValueError, match="without scales"):
        skinny_linear(torch.randn(2, 128, device=device, dtype=dtype), weight, torch.ones(96, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(torch.randn(2, 96, device=device, dtype=dtype), weight.T)

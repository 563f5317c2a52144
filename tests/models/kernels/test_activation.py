import pytest
import torch

from blink.models.kernels import reference
from tests.models.kernels.conftest import rel_err


def test_silu_and_mul(backend):
    device, dtype, tol = backend
    x = torch.randn(13, 2 * 1500, device=device, dtype=dtype) * 3
    from blink.models.kernels.activation import silu_and_mul

    assert rel_err(silu_and_mul(x), reference.silu_and_mul(x)) < tol
    out = torch.full((13, 1500), float("nan"), device=device, dtype=dtype)
    assert silu_and_mul(x, out=out) is out and torch.equal(out, silu_and_mul(x))
    ref_out = torch.empty_like(out)
    assert reference.silu_and_mul(x, out=ref_out) is ref_out and torch.equal(ref_out, reference.silu_and_mul(x))


@pytest.mark.parametrize("wide, group", [(True, None), (True, 128), (False, None)])
def test_silu_and_mul_hands_its_rows_quantized_as_the_quantization_kernel_would(backend, wide, group):
    """``e4m3_group``: one program a row, over more columns than it holds at once (``wide``: ``CHUNK + 640``, 133
    blocks of 128) or all of them (1,000, read once); the same codes and scales as the model-dtype products quantized
    by ``kernels.quantize``, per token (``None``: the row's width) or per token and block of columns."""
    device, dtype, tol = backend
    from blink.models.kernels.activation import silu_and_mul
    from blink.models.kernels.quantize import CHUNK, quantize_activations

    n = CHUNK + 640 if wide else 1000
    group = group or n
    x = torch.randn(3, 2 * n, device=device, dtype=dtype) * 3
    x[1, n // 2:n] *= 6  # gates of one row's last groups larger (below exp's float32 overflow)
    codes, scales, out_dtype = silu_and_mul(x, e4m3_group=group)
    want_codes, want_scales = quantize_activations(silu_and_mul(x), group)
    assert out_dtype == dtype and torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    ref = reference.silu_and_mul(x, e4m3_group=group)
    assert rel_err(ref.dequantized(), reference.silu_and_mul(x)) < 0.05  # the e4m3 rounding itself

import pytest
import torch

from blink.models.kernels import reference
from tests.models.kernels.conftest import rel_err


def test_rms_norm_with_residual(backend):
    device, dtype, tol = backend
    x, res = (torch.randn(37, 200, device=device, dtype=dtype) for _ in range(2))
    w = torch.rand(200, device=device, dtype=dtype) + 0.5
    from blink.models.kernels.norm import rms_norm

    out, total = rms_norm(x, w, 1e-6, res)
    ref_out, ref_total = reference.rms_norm(x, w, 1e-6, res)
    assert rel_err(out, ref_out) < tol and rel_err(total, ref_total) < tol


def test_rms_norm_of_chosen_rows(backend):
    """The final norm of a step takes its sampled rows (``logits_indices``; -1 reads row 0) out of a strided ``x`` and
    the residual in the given order: the rows' normed sums, as the reference, and bit for bit what normalising those
    rows taken out first gives."""
    device, dtype, tol = backend
    x, res = torch.randn(37, 300, device=device, dtype=dtype)[:, :200], torch.randn(37, 200, device=device, dtype=dtype)
    w = torch.rand(200, device=device, dtype=dtype) + 0.5
    rows = torch.tensor([36, 0, -1, 5, 5, 20], dtype=torch.int32, device=device)
    from blink.models.kernels.norm import rms_norm

    out, total = rms_norm(x, w, 1e-6, res, rows=rows)
    ref_out, ref_total = reference.rms_norm(x, w, 1e-6, res, rows=rows)
    assert out.shape == total.shape == (6, 200)
    assert rel_err(out, ref_out) < tol and torch.equal(total, ref_total)
    taken = rows.clamp(min=0).long()
    for got, want in zip((out, total), rms_norm(x[taken], w, 1e-6, res[taken]), strict=True):
        assert torch.equal(got, want)
    out, kept = rms_norm(x, w, 1e-6, rows=rows)  # no residual: the rows taken come back as they are
    assert torch.equal(kept, x[taken]) and torch.equal(out, rms_norm(x[taken], w, 1e-6)[0])


def test_rms_norm_per_head_of_a_strided_view(backend):
    device, dtype, tol = backend
    qkv = torch.randn(9, 6 * 32, device=device, dtype=dtype)
    q = qkv[:, :4 * 32].unflatten(1, (4, 32))  # a view with the fused GEMM's row stride
    w = torch.rand(32, device=device, dtype=dtype) + 0.5
    from blink.models.kernels.norm import rms_norm

    out, same = rms_norm(q, w, 1e-6)
    assert same is q and out.shape == q.shape
    assert rel_err(out, reference.rms_norm(q, w, 1e-6)[0]) < tol


@pytest.mark.parametrize("n, group", [(200, 200), (256, 64), (384, 128)])
def test_rms_norm_hands_its_rows_quantized_as_the_quantization_kernel_would(backend, n, group):
    """``e4m3_group``: the same codes and scales as the model-dtype output quantized by ``kernels.quantize`` (one
    launch less), per token or per token and block of columns, and the reference's, within its tolerance, after
    dequantizing."""
    device, dtype, tol = backend
    x, res = (torch.randn(37, n, device=device, dtype=dtype) for _ in range(2))
    x[3, : n // 2] *= 50  # one row's groups of very different magnitudes
    w = torch.rand(n, device=device, dtype=dtype) + 0.5
    from blink.models.kernels.norm import rms_norm
    from blink.models.kernels.quantize import quantize_activations

    (codes, scales, out_dtype), total = rms_norm(x, w, 1e-6, res, e4m3_group=group)
    plain, plain_total = rms_norm(x, w, 1e-6, res)
    want_codes, want_scales = quantize_activations(plain, group)
    assert out_dtype == dtype and torch.equal(total, plain_total) and torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    ref, _ = reference.rms_norm(x, w, 1e-6, res, e4m3_group=group)
    assert rel_err(ref.dequantized(), plain) < 0.05  # the e4m3 rounding itself (3 mantissa bits)


def test_rms_norm_refuses_a_group_that_is_not_whole_blocks_of_the_row():
    from blink.models.kernels.norm import rms_norm

    x, w = torch.randn(2, 200), torch.ones(200)
    for group in (True, 8, 48, 128):  # a flag, too small, not a power of two, not a divisor of 200
        with pytest.raises(ValueError, match="e4m3_group must be the row's 200 columns"):
            rms_norm(x, w, 1e-6, e4m3_group=group)

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


def test_rms_norm_per_head_of_a_strided_view(backend):
    device, dtype, tol = backend
    qkv = torch.randn(9, 6 * 32, device=device, dtype=dtype)
    q = qkv[:, :4 * 32].unflatten(1, (4, 32))  # a view with the fused GEMM's row stride
    w = torch.rand(32, device=device, dtype=dtype) + 0.5
    from blink.models.kernels.norm import rms_norm

    out, same = rms_norm(q, w, 1e-6)
    assert same is q and out.shape == q.shape
    assert rel_err(out, reference.rms_norm(q, w, 1e-6)[0]) < tol

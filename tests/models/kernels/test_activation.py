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

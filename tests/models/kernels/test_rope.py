import pytest
import torch

from blink.models.kernels import reference
from conftest import rel_err


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_in_place_on_views_of_the_qkv_output(backend, rotary_dim):
    device, dtype, tol = backend
    heads, kv_heads, dim, t = 6, 2, 64, 11
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    angles = torch.rand(100, rotary_dim // 2, device=device) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], 1)
    positions = torch.randint(0, 100, (t,), device=device, dtype=torch.int32)
    ref = qkv.clone()
    from blink.models.kernels.rope import rope

    for buf, fn in ((qkv, rope), (ref, reference.rope)):
        q, k, _ = buf.split([heads * dim, kv_heads * dim, kv_heads * dim], 1)
        fn(q.unflatten(1, (heads, dim)), k.unflatten(1, (kv_heads, dim)), positions, cos_sin)
    assert rel_err(qkv, ref) < tol
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], ref[:, (heads + kv_heads) * dim:])  # v untouched

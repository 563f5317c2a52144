"""The fused q/k RMSNorm + RoPE + KV write against the composed references, on views of one qkv GEMM output,
with partial rotary dims, padding rows (slot -1), a NaN-poisoned pool (unwritten slots must stay NaN), and query
heads that do not fill the kernel's last block of them (9 heads in blocks of 8; 20 in 8, 8 and 4)."""
import pytest
import torch

from blink.models.kernels import reference
from tests.models.kernels.conftest import rel_err


@pytest.mark.parametrize("rotary_dim, norm, heads, kv_heads", [(64, False, 6, 2), (32, False, 6, 2), (64, True, 6, 2),
                                                                (64, True, 9, 3), (64, True, 20, 4)])
def test_rope_kv_write_matches_reference(backend, rotary_dim, norm, heads, kv_heads):
    device, dtype, tol = backend
    dim, t, pages, page_size = 64, 11, 8, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    angles = torch.rand(100, rotary_dim // 2, device=device) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], 1)
    positions = torch.randint(0, 100, (t,), device=device, dtype=torch.int32)
    slots = torch.randperm(pages * page_size, device=device)[:t]
    slots[[3, 7]] = -1
    weights = [torch.rand(dim, device=device, dtype=dtype) + 0.5 for _ in range(2)] if norm else [None, None]
    cache = torch.full((2, pages, page_size, kv_heads, dim), float("nan"), device=device, dtype=dtype)
    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    from blink.models.kernels.rope_kv_write import rope_kv_write

    outs = []
    for buf, pool, fn in ((qkv, cache, rope_kv_write), (ref_qkv, ref_cache, reference.rope_kv_write)):
        q, k, v = (x.unflatten(1, (-1, dim)) for x in buf.split([heads * dim, kv_heads * dim, kv_heads * dim], 1))
        outs.append(fn(q, k, v, positions, cos_sin, pool, slots, *weights, 1e-6))
    assert rel_err(outs[0], outs[1]) < tol
    assert torch.equal(cache.isnan(), ref_cache.isnan()) and (~cache.isnan()).sum() == 2 * (t - 2) * kv_heads * dim
    assert rel_err(cache.nan_to_num(), ref_cache.nan_to_num()) < tol
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], ref_qkv[:, (heads + kv_heads) * dim:])  # v untouched


@pytest.mark.parametrize("norm", [False, True])
def test_rope_kv_write_into_an_e4m3_pool_matches_reference(backend, norm):
    """An FP8 KV cache (``--kv-cache-dtype fp8``): V's codes equal the reference's cast to the last bit, values
    beyond ±448 saturate, padding rows leave their slots as they were (NaN codes); K rotated first, within the
    tolerance."""
    device, dtype, tol = backend
    from blink.models.e4m3 import FP8
    from blink.models.kernels.rope_kv_write import rope_kv_write

    heads, kv_heads, dim, t, pages, page_size = 6, 2, 64, 11, 8, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    qkv[:, -dim:] *= 300  # a head of V mostly past e4m3's largest value
    angles = torch.rand(100, dim // 2, device=device) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], 1)
    positions = torch.randint(0, 100, (t,), device=device, dtype=torch.int32)
    slots = torch.randperm(pages * page_size, device=device)[:t]
    slots[[3, 7]] = -1
    weights = [torch.rand(dim, device=device, dtype=dtype) + 0.5 for _ in range(2)] if norm else [None, None]
    cache = torch.full((2, pages, page_size, kv_heads, dim), 0x7F, device=device, dtype=torch.uint8).view(FP8)
    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    for buf, pool, fn in ((qkv, cache, rope_kv_write), (ref_qkv, ref_cache, reference.rope_kv_write)):
        q, k, v = (x.unflatten(1, (-1, dim)) for x in buf.split([heads * dim, kv_heads * dim, kv_heads * dim], 1))
        fn(q, k, v, positions, cos_sin, pool, slots, *weights, 1e-6)
    codes, ref_codes = cache.view(torch.uint8), ref_cache.view(torch.uint8)
    assert torch.equal(codes[1], ref_codes[1])
    assert (codes == 0x7F).sum() == 2 * (pages * page_size - (t - 2)) * kv_heads * dim  # unwritten slots only
    magnitudes = codes[1].view(-1, kv_heads, dim)[slots[slots >= 0], -1] & 0x7F  # the sign bit off
    assert magnitudes.max() == 0x7E  # saturated at 448 (0x7F would be NaN)
    assert rel_err(cache[0].float().nan_to_num(), ref_cache[0].float().nan_to_num()) < max(tol, 0.07)

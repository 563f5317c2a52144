"""The fused q/k RMSNorm + RoPE + KV write against the composed references, on views of one qkv GEMM output,
with partial rotary dims, padding rows (slot -1), a NaN-poisoned pool (unwritten slots must stay NaN), and query
heads that do not fill the kernel's last block of them (9 heads in blocks of 8; 20 in 8, 8 and 4); and into an e4m3
pool (``--kv-cache-dtype fp8``)."""
import pytest
import torch

from blink.models.kernels import reference
from tests.models.kernels.conftest import rel_err

DIM, TOKENS, PAGES, PAGE_SIZE = 64, 11, 8, 4


def run_both(device, dtype, heads, kv_heads, rotary_dim, norm, cache, v_scale=1.0):
    """The kernel and the reference on the same inputs (rows 3 and 7 padding: slot -1), each into its own copy of
    ``cache``: (their rotated q's, their qkv buffers, their pools, the slots)."""
    from blink.models.kernels.rope_kv_write import rope_kv_write

    qkv = torch.randn(TOKENS, (heads + 2 * kv_heads) * DIM, device=device, dtype=dtype)
    qkv[:, -DIM:] *= v_scale  # the last head of V
    angles = torch.rand(100, rotary_dim // 2, device=device) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], 1)
    positions = torch.randint(0, 100, (TOKENS,), device=device, dtype=torch.int32)
    slots = torch.randperm(PAGES * PAGE_SIZE, device=device)[:TOKENS]
    slots[[3, 7]] = -1
    weights = [torch.rand(DIM, device=device, dtype=dtype) + 0.5 for _ in range(2)] if norm else [None, None]
    bufs, pools, outs = (qkv, qkv.clone()), (cache, cache.clone()), []
    for buf, pool, fn in zip(bufs, pools, (rope_kv_write, reference.rope_kv_write)):
        q, k, v = (x.unflatten(1, (-1, DIM)) for x in buf.split([heads * DIM, kv_heads * DIM, kv_heads * DIM], 1))
        outs.append(fn(q, k, v, positions, cos_sin, pool, slots, *weights, 1e-6))
    return outs, bufs, pools, slots


@pytest.mark.parametrize("rotary_dim, norm, heads, kv_heads", [(64, False, 6, 2), (32, False, 6, 2), (64, True, 6, 2),
                                                                (64, True, 9, 3), (64, True, 20, 4)])
def test_rope_kv_write_matches_reference(backend, rotary_dim, norm, heads, kv_heads):
    device, dtype, tol = backend
    cache = torch.full((2, PAGES, PAGE_SIZE, kv_heads, DIM), float("nan"), device=device, dtype=dtype)
    outs, (qkv, ref_qkv), (cache, ref_cache), _ = run_both(device, dtype, heads, kv_heads, rotary_dim, norm, cache)
    assert rel_err(outs[0], outs[1]) < tol
    assert torch.equal(cache.isnan(), ref_cache.isnan())
    assert (~cache.isnan()).sum() == 2 * (TOKENS - 2) * kv_heads * DIM
    assert rel_err(cache.nan_to_num(), ref_cache.nan_to_num()) < tol
    assert torch.equal(qkv[:, (heads + kv_heads) * DIM:], ref_qkv[:, (heads + kv_heads) * DIM:])  # v untouched


@pytest.mark.parametrize("norm", [False, True])
def test_rope_kv_write_into_an_e4m3_pool_matches_reference(backend, norm):
    """An FP8 KV cache: V's codes equal the reference's cast to the last bit, values beyond ±448 saturate, padding
    rows leave their slots as they were (NaN codes); K rotated first, within the tolerance."""
    device, dtype, tol = backend
    from blink.models.e4m3 import FP8

    kv_heads = 2
    cache = torch.full((2, PAGES, PAGE_SIZE, kv_heads, DIM), 0x7F, device=device, dtype=torch.uint8).view(FP8)
    # the last head of V mostly past e4m3's largest value
    _, _, (cache, ref_cache), slots = run_both(device, dtype, 6, kv_heads, DIM, norm, cache, v_scale=300)
    codes, ref_codes = cache.view(torch.uint8), ref_cache.view(torch.uint8)
    assert torch.equal(codes[1], ref_codes[1])
    assert (codes == 0x7F).sum() == 2 * (PAGES * PAGE_SIZE - (TOKENS - 2)) * kv_heads * DIM  # unwritten slots only
    magnitudes = codes[1].view(-1, kv_heads, DIM)[slots[slots >= 0], -1] & 0x7F  # the sign bit off
    assert magnitudes.max() == 0x7E  # saturated at 448 (0x7F would be NaN)
    # K: the kernel's rotation may differ from the reference's in the model dtype's last bit (bf16), which can move a
    # code to its neighbour, 1/16 apart; in float32 they agree
    assert rel_err(cache[0].float().nan_to_num(), ref_cache[0].float().nan_to_num()) < max(tol, 0.02)

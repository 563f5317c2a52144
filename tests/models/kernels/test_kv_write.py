import torch

from blink.models.kernels import reference


def test_kv_write_skips_padding_and_touches_nothing_else(backend):
    device, dtype, _ = backend
    t, kv_heads, dim, pages, page_size = 10, 3, 16, 8, 4
    kv = torch.randn(t, 2 * kv_heads * dim, device=device, dtype=dtype)
    k, v = (x.unflatten(1, (kv_heads, dim)) for x in kv.chunk(2, 1))
    slots = torch.randperm(pages * page_size, device=device)[:t]
    slots[[3, 7]] = -1
    cache = torch.full((2, pages, page_size, kv_heads, dim), float("nan"), device=device, dtype=dtype)
    ref = cache.clone()
    from blink.models.kernels.kv_write import kv_write

    kv_write(k, v, cache, slots)
    reference.kv_write(k, v, ref, slots)
    assert torch.equal(cache.isnan(), ref.isnan()) and (~cache.isnan()).sum() == 2 * 8 * kv_heads * dim
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())

"""Split-K GEMMs summed in the kernel (``split_k``): every call right against float64, the tile counters back at 0
after each launch, and the parts summed in part order (the same output whatever order they finish in)."""
import pytest
import torch

from blink.models.e4m3 import dequantize, quantize_activations
from tests.models.kernels.conftest import rel_err
from tests.models.kernels.test_fp8 import dequantized_activations, fp8_weights


def skinny(x, weight, scale):
    from blink.models.kernels.skinny import SkinnyTiles, skinny_linear

    want = x.double() @ dequantize(weight, scale, None).double().T
    return skinny_linear(x, weight, scale, None, SkinnyTiles(block_n=16, block_k=64, split_k=4)), want


def gemm(x, weight, scale):
    from blink.models.kernels.fp8 import Tiles, fp8_gemm

    want = dequantized_activations(x, x.shape[1]) @ dequantize(weight, scale, None).double().T
    tiles = Tiles(block_m=16, block_n=32, block_k=64, split_k=3)
    return fp8_gemm(*quantize_activations(x, x.shape[1]), weight, scale, None, x.dtype, tiles), want


def counters_of(weight, tiles: int | None = None) -> list[torch.Tensor]:
    """The counters kept for ``weight``'s address (of launches of ``tiles`` output tiles, or of any): on the GPU a
    weight freed by an earlier test may have left its own at the address, which this weight inherits."""
    from blink.models.kernels.split_k import _counters

    return [c for (device, address, n), c in _counters.items() if device == weight.device
            and address == weight.data_ptr() and tiles in (None, n)]


@pytest.mark.parametrize("gemm_fn", [skinny, gemm])
def test_split_k_parts_are_summed_by_the_last_and_leave_the_counters_at_zero(backend, gemm_fn):
    device, dtype, tol = backend
    weight, scale = fp8_weights((160, 320), None, device)
    for tokens in (7, 20, 7):  # a launch that left a counter raised would leave the next call's tiles unsummed
        x = torch.randn(tokens, 320, device=device, dtype=dtype)
        out, want = gemm_fn(x, weight, scale)
        assert rel_err(out, want) < tol
        assert counters_of(weight) and not any(c.any() for c in counters_of(weight))


def test_each_weight_has_its_own_counters(backend):
    """Two models' steps may run at once on one GPU: a weight's counters are its own, one per launch shape."""
    device, dtype, _ = backend
    first, second = fp8_weights((160, 320), None, device), fp8_weights((160, 320), None, device)
    x = torch.randn(7, 320, device=device, dtype=dtype)
    for weight, scale in (first, second):
        skinny(x, weight, scale)
    tiles = 160 // 16  # skinny's one row of 16-output tiles
    assert len(counters_of(first[0], tiles)) == len(counters_of(second[0], tiles)) == 1
    assert counters_of(first[0], tiles)[0].data_ptr() != counters_of(second[0], tiles)[0].data_ptr()


@pytest.mark.gpu
def test_split_k_output_does_not_depend_on_the_order_parts_finish():
    """The last part sums every part in part order, so repeated launches agree bit for bit (atomic adds, in
    arrival order, would not); on the GPU, where parts run concurrently."""
    weight, scale = fp8_weights((4096, 12288), None, "cuda")
    x = torch.randn(4, 12288, device="cuda", dtype=torch.bfloat16)
    first, _ = skinny(x, weight, scale)
    for _ in range(20):
        assert torch.equal(skinny(x, weight, scale)[0], first)

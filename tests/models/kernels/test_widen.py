"""``widen``: every e4m3 code to bf16 by moving bits (the compiled path's inline PTX) against torch's conversion, bit
for bit, in the tile shapes the kernels widen (the skinny GEMM's weights, attention's K and V)."""
import pytest
import torch

from blink.models.e4m3 import FP8

triton = pytest.importorskip("triton")
tl = triton.language

from blink.models.kernels.widen import widen  # noqa: E402


@triton.jit
def _widen_kernel(codes_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(out_ptr + offsets, widen(tl.load(codes_ptr + offsets), tl.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,warps", [(32, 128, 4), (64, 128, 4), (64, 256, 8), (16, 16, 1)])
def test_widen_equals_torch_for_every_e4m3_code(rows, cols, warps):
    codes = torch.arange(rows * cols, device="cuda").remainder(256).to(torch.uint8)
    codes = codes[torch.randperm(codes.numel(), device="cuda")].view(rows, cols)  # each thread sees mixed codes
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
    _widen_kernel[(1,)](codes.view(FP8), out, ROWS=rows, COLS=cols, num_warps=warps)
    want = codes.view(FP8).to(torch.bfloat16)
    nan_code = (codes & 0x7F) == 0x7F  # never written (the quantizers clamp to 448): documented as +-480
    assert torch.equal(out.view(torch.int16)[~nan_code], want.view(torch.int16)[~nan_code])
    assert torch.equal(out[nan_code].float().abs(), torch.full_like(out[nan_code].float(), 480.0))

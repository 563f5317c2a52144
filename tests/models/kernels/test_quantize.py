"""The activations' quantization kernel against ``e4m3.quantize_activations`` (torch's ops): the same scales and the
same e4m3 bits, in Triton's interpreter (float32) and on the GPU (bf16)."""
import pytest
import torch

from blink.models.e4m3 import FP8, FP8_MAX, quantize_activations as reference


def activations(rows, cols, dtype):
    """Rows over twelve decades of magnitude, a row of zeros, and values that land exactly on e4m3 ties and on the
    carries into the next power of two (126 → 128, 248 → 256), and in the subnormals, once scaled."""
    x = torch.randn(rows, cols, dtype=torch.float64) * torch.logspace(-6, 6, rows, dtype=torch.float64)[:, None]
    x[1] = 0
    special = torch.tensor([FP8_MAX, 126.0, -248.0, 336.0, -13.0, 0.0048828125, 2.0 ** -10, 3 * 2.0 ** -10,
                            0.01, -1e-9, 17.0, 300.0])
    x[2, :special.numel()] = special.double()
    return x.to(dtype)


@pytest.mark.parametrize("group", [None, 128])
def test_quantize_kernel_equals_torch_bit_for_bit(backend, group):
    device, dtype, _ = backend
    from blink.models.kernels.quantize import quantize_activations

    x = activations(9, 2304, dtype).to(device)
    group = group or x.shape[1]
    out, scale = quantize_activations(x, group)
    want, want_scale = reference(x, group)
    assert out.dtype == FP8 and out.shape == x.shape and scale.shape == want_scale.shape
    assert torch.equal(scale, want_scale)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_round_to_e4m3_every_tie_and_carry(backend):
    """Every e4m3 value, the midpoints between neighbours (ties to even) and points just either side of them."""
    device, _, _ = backend
    from blink.models.kernels.quantize import quantize_activations

    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, values[-1:]),
                     -mids])
    x = torch.cat([row, torch.full((-row.numel() % 16,), FP8_MAX)])[None].to(device)  # amax 448: scale 1
    out, scale = quantize_activations(x, x.shape[1])
    assert scale.item() == 1.0
    assert torch.equal(out.view(torch.uint8), x.float().to(FP8).view(torch.uint8))


def test_quantize_refuses_a_partial_group():
    from blink.models.kernels.quantize import quantize_activations

    with pytest.raises(ValueError, match="groups of 128"):
        quantize_activations(torch.ones(2, 200), 128)

"""The activations' quantization kernel against ``e4m3.quantize_activations`` run on the CPU (correctly rounded
divisions; torch on CUDA multiplies by a scalar divisor's reciprocal): the same scales and the same e4m3 codes, in
Triton's interpreter (float32) and on the GPU (bf16)."""
import pytest
import torch

from blink.models.e4m3 import FP8, FP8_MAX, quantize_activations as reference


def activations(rows, cols, dtype):
    """Rows over twelve decades of magnitude, a row of zeros, and values that land exactly on e4m3 ties and on the
    carries into the next power of two (126 → 128, 248 → 256), in the subnormals and on negative zero, once
    scaled."""
    x = torch.randn(rows, cols, dtype=torch.float64) * torch.logspace(-6, 6, rows, dtype=torch.float64)[:, None]
    x[1] = 0
    special = torch.tensor([FP8_MAX, 126.0, -248.0, 336.0, -13.0, 0.0048828125, 2.0 ** -10, 3 * 2.0 ** -10,
                            0.01, -1e-9, -0.0, 17.0, 300.0])
    x[2, :special.numel()] = special.double()
    return x.to(dtype)


def assert_same_codes(x, out, want):
    """``out`` and ``want`` (e4m3) hold the same codes; else name the first inputs where they differ."""
    got, expected = out.cpu().view(torch.uint8), want.view(torch.uint8)
    wrong = (got != expected).nonzero()[:8].tolist()
    assert not wrong, "codes differ at (row, col) / input / kernel / reference: " + "; ".join(
        f"{tuple(i)} {x[tuple(i)].item()!r} {got[tuple(i)].item():#04x} {expected[tuple(i)].item():#04x}"
        for i in wrong)


@pytest.mark.parametrize("cols, group", [(2304, None), (2304, 128), ("CHUNK + 640", None)])
def test_quantize_kernel_equals_torch_bit_for_bit(backend, cols, group):
    """Per token and per 128 columns; a row longer than a program's ``CHUNK`` is read in two steps."""
    device, dtype, _ = backend
    from blink.models.kernels.quantize import CHUNK, quantize_activations

    x = activations(9, CHUNK + 640 if cols == "CHUNK + 640" else cols, dtype)
    group = group or x.shape[1]
    out, scale = quantize_activations(x.to(device), group)
    want, want_scale = reference(x, group)
    assert out.dtype == FP8 and out.shape == x.shape and scale.shape == want_scale.shape
    assert torch.equal(scale.cpu(), want_scale)
    assert_same_codes(x, out, want)


def test_quantize_kernel_rounds_every_tie_and_carry_as_torch_casts(backend):
    """Every e4m3 value, the midpoints between neighbours (ties to even) and points just either side of them."""
    device, _, _ = backend
    from blink.models.kernels.quantize import quantize_activations

    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, values[-1:]),
                     -mids])
    x = torch.cat([row, torch.full((-row.numel() % 16,), FP8_MAX)])[None]  # amax 448: the scale is 1
    out, scale = quantize_activations(x.to(device), x.shape[1])
    assert scale.item() == 1.0
    assert_same_codes(x, out, x.to(FP8))


def test_quantize_kernel_reads_strided_views(backend):
    """A view of every other column (copied first) and one of the first columns of wider rows (read in place)."""
    device, dtype, _ = backend
    from blink.models.kernels.quantize import quantize_activations

    wide = activations(5, 1024, dtype)
    for view in (wide[:, ::2], wide[:, :256]):
        out, scale = quantize_activations(view.to(device), 128)
        want, want_scale = reference(view, 128)
        assert torch.equal(scale.cpu(), want_scale)
        assert_same_codes(view, out, want)


def test_quantize_refuses_a_partial_group():
    from blink.models.kernels.quantize import quantize_activations

    with pytest.raises(ValueError, match="not whole groups of 128"):
        quantize_activations(torch.ones(2, 200), 128)

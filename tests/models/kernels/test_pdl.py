"""Programmatic dependent launch: each step kernel, launched right after a producer that lets it be placed at once
and writes the kernel's input only later, must still read the written input (its programs wait). The producer is a
copy that triggers its dependents first and then spins on global loads for a while; the kernel's result on the late
copy must equal its result on the original, bit for bit. Without the wait a kernel reads the zeros."""
import pytest
import torch
import triton
import triton.language as tl

from blink.models.kernels.pdl import pdl_args, pdl_enabled

SPINS = 20000  # dependent global loads before the producer copies: tens of microseconds


def test_pdl_is_off_without_cuda_and_when_disabled(monkeypatch):
    monkeypatch.delenv("BLINK_PDL", raising=False)
    assert not pdl_enabled(torch.device("cpu"))
    assert pdl_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv("BLINK_PDL", "0")
    assert pdl_args(torch.device("cuda", 0)) == {"PDL": False, "launch_pdl": False}  # decided before any CUDA call


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, flag_ptr, n, spins, BLOCK: tl.constexpr):
    tl.extra.cuda.gdc_launch_dependents()  # the next kernel may be placed at once
    seen = 0
    for _ in range(spins):
        seen += tl.load(flag_ptr, volatile=True)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < n) & (seen == 0)  # the copy depends on the spin, so it cannot be moved ahead of it
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def _late_copy(src: torch.Tensor) -> torch.Tensor:
    """A zeroed tensor that a producer kernel fills with ``src`` after letting the next kernel launch."""
    dst = torch.zeros_like(src)
    flag = torch.zeros(1, dtype=torch.int32, device=src.device)
    _late_copy_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, flag, src.numel(), SPINS, BLOCK=1024)
    return dst


# Each ``_setup_*`` makes a kernel's other inputs, then returns the launch alone: nothing may run between the
# producer and the kernel, or the kernel would follow that instead.

def _setup_rms_norm(x):
    from blink.models.kernels.norm import rms_norm

    weight, residual = torch.full((x.shape[1],), 1.5, device=x.device, dtype=x.dtype), torch.ones_like(x)
    return lambda x: torch.cat(rms_norm(x, weight, 1e-6, residual))


def _setup_silu_and_mul(x):
    from blink.models.kernels.activation import silu_and_mul

    return silu_and_mul


def _setup_rope_kv_write(q):
    from blink.models.kernels.rope_kv_write import rope_kv_write

    t, dim = q.shape[0], q.shape[2]
    k, v = (torch.ones(t, 2, dim, device=q.device, dtype=q.dtype) for _ in range(2))
    angles = torch.arange(32 * dim // 2, device=q.device).view(32, dim // 2) * 0.01
    cos_sin = torch.cat([angles.cos(), angles.sin()], 1)
    cache = torch.zeros(2, 4, 16, 2, dim, device=q.device, dtype=q.dtype)
    positions = torch.arange(t, device=q.device, dtype=torch.int32)
    slots = positions.long()

    def run(q):
        q = rope_kv_write(q, k, v, positions, cos_sin, cache, slots, None, None, 0.0)
        return torch.cat([q.flatten(), cache.flatten()])
    return run


def _setup_attention(q):
    """A batch of decodes with split KV: the attention kernel waits for q, the combine kernel for the partials."""
    from blink.device.step import StepBuffers, StepLayout
    from blink.models.batch import SeqChunk, fill_step
    from blink.models.kernels.attention import attention, attention_plan

    seqs, heads, dim = q.shape
    buf = StepBuffers(StepLayout(64, 64, 8), q.device)
    fill_step(buf, [SeqChunk([1], 40 * i, list(range(8 * i, 8 * i + 8))) for i in range(seqs)], 16)
    gen = torch.Generator(q.device).manual_seed(0)
    cache = torch.randn(2, 8 * seqs, 16, 2, dim, device=q.device, dtype=q.dtype, generator=gen)
    plan = attention_plan(buf, seqs, heads, 2, dim, 16, q.dtype, num_splits=4)
    return lambda q: attention(q, cache, plan, dim ** -0.5).clone()


def _setup_row_logsumexp(logits):
    from blink.models.kernels.sampling import row_logsumexp

    divisor = torch.full((logits.shape[0],), 0.7, device=logits.device)
    floor = torch.full((logits.shape[0],), -1.0, device=logits.device)
    return lambda logits: torch.cat(row_logsumexp(logits, divisor, floor))


def _setup_sampling_params(cand):
    from blink.models.kernels.sampling import sampling_params

    temperature = torch.full((cand.shape[0],), 0.7, device=cand.device)
    min_p = torch.full((cand.shape[0],), 0.1, device=cand.device)
    return lambda cand: torch.cat(sampling_params(temperature, min_p, cand)[1:])


def _setup_top_candidates(logits):
    """Every row samples and filters, so each of the select's kernels reads the logits."""
    from blink.models.kernels.top_candidates import top_candidates

    rows, device = logits.shape[0], logits.device
    step = (torch.arange(rows, device=device), torch.zeros(rows, dtype=torch.int32, device=device),
            torch.full((rows,), 0.9, device=device), torch.zeros(rows, device=device))

    def run(logits):
        values, ids = top_candidates(logits, 1024, *step, 0)
        return torch.cat([values.float().flatten(), ids.float().flatten()])
    return run


KERNELS = {  # name: (setup of a kernel reading a tensor of the shape, shape, dtype)
    "rms_norm": (_setup_rms_norm, (8, 4096), torch.bfloat16),
    "silu_and_mul": (_setup_silu_and_mul, (8, 2 * 4096), torch.bfloat16),
    "rope_kv_write": (_setup_rope_kv_write, (8, 8, 64), torch.bfloat16),
    "attention": (_setup_attention, (4, 8, 64), torch.bfloat16),
    "row_logsumexp": (_setup_row_logsumexp, (4, 50000), torch.float32),
    "sampling_params": (_setup_sampling_params, (300, 64), torch.bfloat16),
    "top_candidates": (_setup_top_candidates, (4, 50000), torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_waits_for_a_late_producer(name):
    if not pdl_enabled(torch.device("cuda")):
        pytest.skip("PDL is off (BLINK_PDL=0 or a GPU before Hopper)")
    setup, shape, dtype = KERNELS[name]
    src = torch.randn(shape, device="cuda", dtype=dtype)
    want = setup(src)(src.clone())
    run = setup(src)
    torch.cuda.synchronize()
    got = run(_late_copy(src))
    torch.cuda.synchronize()
    assert torch.equal(got, want), f"{name} read its input before the producer wrote it"

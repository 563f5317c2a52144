"""``apply_logit_bias`` (the Triton kernel and the torch reference) against float64, and the whole sampler (bias,
min-p, top logprobs) captured in a CUDA graph against its eager run."""
import pytest
import torch

from blink.models.kernels import bias as triton_bias
from blink.models.kernels import reference

IMPLEMENTATIONS = {"triton": triton_bias.apply_logit_bias, "reference": reference.apply_logit_bias}


def _reference(logits, ids, bias, count):
    """float64: each valid pair (j < count, id in the vocabulary) adds its bias, rounded once to the logits' dtype."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        for j in range(int(count[r])):
            t = int(ids[r, j])
            if 0 <= t < logits.shape[1]:
                out[r, t] = (logits[r, t].double() + float(bias[r, j])).to(logits.dtype)
    return out


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_logit_bias_matches_float64(backend, impl):
    """Rows with no pair, some pairs, every pair; stale entries past the count and ids outside the vocabulary
    (ignored); token 0 biased while padding entries default to it; bf16 logits rounded once."""
    device, dtype, _ = backend
    rows, vocab = 6, 1000
    logits = (torch.randn(rows, vocab, device=device) * 4).to(dtype)
    ids = torch.tensor([[3, 9, 0, 7, 1], [0, 5, 2, 8, 4], [999, -1, 1000, 12, 0], [7, 7, 7, 7, 7],
                        [1, 2, 3, 4, 5], [0, 1, 2, 3, 4]], dtype=torch.int32, device=device)
    bias = torch.tensor([[1.5, -100, 100, 0.25, 3], [-2.5, 1, 1, 1, 1], [4, 4, 4, -7.75, 9],
                         [50, 50, 50, 50, 50], [0.1, 0.2, 0.3, 0.4, 0.5], [9, 9, 9, 9, 9]], device=device)
    count = torch.tensor([2, 1, 4, 1, 5, 0], dtype=torch.int32, device=device)
    want = _reference(logits, ids, bias, count)
    IMPLEMENTATIONS[impl](logits, ids, bias, count)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_no_pairs_leave_the_logits_as_they_are(backend, impl):
    device, dtype, _ = backend
    apply_logit_bias = IMPLEMENTATIONS[impl]
    logits = torch.randn(3, 50, device=device).to(dtype)
    before = logits.clone()
    apply_logit_bias(logits, torch.zeros(3, 0, dtype=torch.int32, device=device), torch.zeros(3, 0, device=device),
                     torch.zeros(3, dtype=torch.int32, device=device))
    apply_logit_bias(logits, torch.full((3, 4), 7, dtype=torch.int32, device=device),
                     torch.full((3, 4), 5.0, device=device), torch.zeros(3, dtype=torch.int32, device=device))
    assert torch.equal(logits, before)


@pytest.mark.gpu
def test_biased_min_p_sampling_with_top_logprobs_captures_in_a_cuda_graph():
    """Fixed shapes, no host read: the step's bias + sampler captured once, replayed on new inputs written into the
    same buffers, gives what the eager run gives (tokens, logprobs, top tokens and top logprobs)."""
    from blink.models.kernels import triton_ops
    from blink.models.sampler import sample
    from tests.models.test_sampler import empty_sampled

    rows, vocab, width, top = 8, 32000, 6, 5
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.empty(rows, vocab, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(rows, width, dtype=torch.int32, device="cuda")
    bias = torch.zeros(rows, width, device="cuda")
    count = torch.zeros(rows, dtype=torch.int32, device="cuda")
    temperature, top_p, min_p = (torch.zeros(rows, device="cuda"), torch.ones(rows, device="cuda"),
                                 torch.zeros(rows, device="cuda"))
    top_k = torch.zeros(rows, dtype=torch.int32, device="cuda")
    seed, seq_lens = torch.arange(rows, device="cuda"), torch.full((rows,), 7, dtype=torch.int32, device="cuda")

    def fill(k):
        logits.copy_((torch.randn(rows, vocab, device="cuda", generator=gen) * 3).bfloat16())
        ids.copy_(torch.randint(0, vocab, (rows, width), device="cuda", generator=gen, dtype=torch.int32))
        bias.copy_(torch.rand(rows, width, device="cuda", generator=gen) * 20 - 10)
        count.copy_(torch.arange(rows, device="cuda", dtype=torch.int32) % (width + 1))
        temperature.copy_(torch.tensor([0, 0.7, 1.0, 1.3] * 2, device="cuda") * (k + 1))
        min_p.copy_(torch.tensor([0, 0.05, 0.2, 0.9] * 2, device="cuda"))

    rows_sampled = torch.arange(rows, device="cuda")

    def step(out=None):
        out = empty_sampled(rows, top, "cuda") if out is None else out
        triton_ops.apply_logit_bias(logits, ids, bias, count)
        sample(logits, temperature, top_k, top_p, min_p, seed, seq_lens, triton_ops, out, rows_sampled)
        return out

    fill(0)
    step()                                      # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    fill(0)
    captured = empty_sampled(rows, top, "cuda")
    with torch.cuda.graph(graph):
        step(captured)
    for k in range(3):
        fill(k)
        saved = logits.clone()
        graph.replay()
        got = [x.clone() for x in captured]
        logits.copy_(saved)
        want = step()
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)

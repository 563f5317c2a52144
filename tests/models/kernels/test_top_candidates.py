import pytest
import torch

from blink.models.kernels import reference


def _rows(vocab, n, device):
    """bf16 rows with ties everywhere (bf16 has few values), a tie wider than ``n``, infinities and signed zeros,
    exactly ``n`` entries in the top bin (with a low digit 0), and rows that read no candidates."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, vocab, generator=g) * 4).bfloat16()
    logits[0, :vocab // 2] = 1.0
    logits[1] = torch.randint(-3, 3, (vocab,), generator=g).bfloat16()
    logits[1, 0] = float("-inf")
    logits[2, :7] = torch.tensor([float("inf"), 0.0, -0.0, 3e38, -3e38, 1e-7, -1e-7]).bfloat16()
    logits[3, -n:] = 32768.0  # bf16 0x4700: the n-th largest key's low digit is 0, the bin non-matching entries fill
    step = dict(logits_indices=torch.tensor([0, 1, 2, 3, 4, -1, 6, 7]), top_k=torch.tensor([5, 0, 0, 2000, 0, 5, 0, 0]),
                top_p=torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0]),
                min_p=torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.3]))
    step["top_k"] = step["top_k"].int()
    return logits.to(device), {k: v.to(device) for k, v in step.items()}


@pytest.mark.parametrize("top", [0, 3])
def test_top_candidates_equal_torch_topk_in_the_rows_that_read_them(backend, top):
    """Over 4096-entry chunks (a vocabulary not a multiple of them): the values equal the reference's (``torch.topk``)
    bit for bit, descending; each id points at its value, distinct; equal logits in increasing id order, and of
    those equal to the n-th largest the lowest ids (whatever order the chunks run in). Rows that
    read no candidates (greedy-like, not sampling) get -inf and id 0 unless the step writes top logprobs."""
    from blink.models.kernels.top_candidates import top_candidates

    device, _, _ = backend
    vocab, n = 3 * 4096 - 5, 1000
    logits, step = _rows(vocab, n, device)
    values, ids = top_candidates(logits, n, *step.values(), top)
    want_values, want_ids = reference.top_candidates(logits, n, *step.values(), top)
    assert values.dtype == want_values.dtype == logits.dtype and ids.dtype == want_ids.dtype == torch.int64
    assert torch.equal(values, want_values)
    needs = want_values[:, 0] > float("-inf")
    expected = [True, True, True, True, top > 0, False, top > 0, True]
    assert needs.tolist() == expected
    assert torch.equal(ids[~needs], torch.zeros_like(ids[~needs]))
    for row in needs.nonzero()[:, 0].tolist():
        assert torch.equal(logits[row, ids[row]], values[row])
        assert ids[row].unique().numel() == n
        tied = values[row, 1:] == values[row, :-1]
        assert torch.all(ids[row, 1:][tied] > ids[row, :-1][tied])
        last = ids[row][values[row] == values[row, -1]]  # of the entries equal to the n-th largest, the lowest ids
        assert torch.equal(last, (logits[row] == values[row, -1]).nonzero()[:last.numel(), 0])
    assert torch.equal(ids[3], torch.arange(vocab - n, vocab, device=device))  # the n entries of the top bin, in order


def test_top_candidates_of_float32_logits_are_the_reference(backend):
    from blink.models.kernels.top_candidates import top_candidates

    device, _, _ = backend
    logits, step = _rows(5000, 100, device)
    got = top_candidates(logits.float(), 100, *step.values(), 0)
    want = reference.top_candidates(logits.float(), 100, *step.values(), 0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

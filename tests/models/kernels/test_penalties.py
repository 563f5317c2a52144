"""``apply_penalties`` (Triton and torch reference) against vLLM's formula, written out in float64 row by row over
each row's unique tokens."""
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from blink.models.kernels import reference

PROMPT_ONLY, OUTPUT_ONLY, BOTH = 900, 901, 902  # marked tokens every mixed history repeats in those places
LONG = 3 * 4096 + 125  # several of the kernel's chunks (not imported: the reference tests run without Triton)


@dataclass
class Case:
    """A batch of histories (lists of token ids, position order) and per-row penalties. ``shared[r] = (a, n)``: row
    ``r``'s first ``n`` pages are row ``a``'s (a cached prefix), so its history starts with those tokens."""

    histories: list
    prompt_lens: list
    presence: list
    frequency: list
    repetition: list
    vocab: int
    page_size: int
    max_pages: int
    shared: dict = field(default_factory=dict)


def _tokens(g, n, high=40):
    """``n`` ids from a small range: repeats are the rule."""
    return torch.randint(0, high, (n,), generator=g).tolist()


def _mixed_rows():
    """Repeats in the prompt, in the output and in both, a row sharing another's pages, a neutral row, an empty
    row, a prompt-only row, a partial prefill (prompt longer than the history), ids outside the vocabulary, and
    both signs of every penalty (repetition both sides of 1)."""
    g = torch.Generator().manual_seed(1)
    ps = 4
    h0 = (_tokens(g, 10) + [PROMPT_ONLY, BOTH, PROMPT_ONLY, 5]) + (_tokens(g, 14) + [OUTPUT_ONLY, BOTH] * 3)
    h1 = h0[:2 * ps] + _tokens(g, 20)
    odd = [-1, 1000, 1007, -3]  # the vocabulary is 1000 ids: these are ignored
    histories = [h0, h1, _tokens(g, 30), [], _tokens(g, 25), odd + _tokens(g, 9) + odd + [999, 999, 0],
                 _tokens(g, 19), _tokens(g, 48, high=1000)]
    return Case(histories=histories, prompt_lens=[14, 11, 12, 0, 25, 8, 29, 20],
                presence=[0.5, -1.0, 0.0, 0.7, 0.0, 1.5, 0.3, -2.0],
                frequency=[0.25, -0.5, 0.0, 0.2, 0.0, -1.25, 2.0, -0.75],
                repetition=[1.3, 0.7, 1.0, 1.2, 1.5, 2.0, 1.1, 0.8],
                vocab=1000, page_size=ps, max_pages=12, shared={1: (0, 2)})


def _long_history():
    """One row over several of the kernel's chunks, its prompt crossing a chunk boundary and its tokens repeated in
    every chunk, beside a short row; a vocabulary that is no multiple of any block."""
    g = torch.Generator().manual_seed(2)
    long = _tokens(g, LONG - 2, high=300) + [5002, 5003]
    return Case(histories=[long, _tokens(g, 50)], prompt_lens=[4096 + 500, 20], presence=[0.4, 0.1],
                frequency=[0.01, 0.3], repetition=[1.2, 0.9], vocab=5003, page_size=16,
                max_pages=-(-len(long) // 16) + 3)


def _inputs(case, device, dtype):
    """The kernel's arguments for ``case``: histories in pages of a shuffled pool whose unused slots hold random
    ids, and block table entries past a row's pages pointing outside the pool (neither may be read)."""
    g = torch.Generator().manual_seed(3)
    rows, ps = len(case.histories), case.page_size
    num_pages = sum(-(-len(h) // ps) for h in case.histories)
    free = torch.randperm(num_pages, generator=g).tolist()
    page_tokens = torch.randint(0, case.vocab, (num_pages * ps,), generator=g, dtype=torch.int32)
    block_tables = torch.full((rows, case.max_pages), 1 << 20, dtype=torch.int32)
    for r, history in enumerate(case.histories):
        owner, n = case.shared.get(r, (r, 0))
        block_tables[r, :n] = block_tables[owner, :n]
        for j in range(n, -(-len(history) // ps)):
            block_tables[r, j] = page = free.pop()
            chunk = history[j * ps:(j + 1) * ps]
            page_tokens[page * ps:page * ps + len(chunk)] = torch.tensor(chunk, dtype=torch.int32)
    logits = (torch.randn(rows, case.vocab, generator=g) * 3).to(dtype)
    logits[:, :3] = -0.0  # untouched entries must keep their sign bit

    # The rows of [S, 4], as the step buffers' rows sit at a stride of their own: a kernel that read the columns at
    # the wrong stride would see other rows' penalties.
    penalties = torch.tensor([[*row, 7.0] for row in zip(case.presence, case.frequency, case.repetition)],
                             dtype=torch.float32, device=device)[:, :3]
    i32 = {"dtype": torch.int32, "device": device}
    return dict(logits=logits.to(device), page_tokens=page_tokens.to(device), block_tables=block_tables.to(device),
                seq_lens=torch.tensor([len(h) for h in case.histories], **i32),
                prompt_lens=torch.tensor(case.prompt_lens, **i32), penalties=penalties,
                counts=torch.zeros(rows, case.vocab, **i32), page_size=ps)


def _expected(case, args):
    """vLLM's penalties on float64 copies of the logits, and the mask of the (row, token) pairs it adjusts."""
    want = args["logits"].double().cpu()
    touched = torch.zeros(want.shape, dtype=torch.bool)
    penalties = args["penalties"].tolist()  # their float32 values
    for r, (history, (presence, frequency, rep)) in enumerate(zip(case.histories, penalties)):
        if (presence, frequency, rep) == (0, 0, 1):
            continue
        in_prompt, output = set(history[:case.prompt_lens[r]]), Counter(history[case.prompt_lens[r]:])
        for t in in_prompt | set(output):
            if not 0 <= t < case.vocab:
                continue
            x, c = want[r, t].item(), output[t]
            if rep != 1:
                x = x / rep if x > 0 else x * rep
            want[r, t] = x - (frequency * c + presence * (c > 0))
            touched[r, t] = True
    return want, touched


def _bits(x):
    return x.cpu().view(torch.int16 if x.element_size() == 2 else torch.int32)


def _check(apply, case, device, dtype, tol):
    args = _inputs(case, device, dtype)
    before = args["logits"].clone()
    want, touched = _expected(case, args)
    apply(**args)
    got = args["logits"]
    assert got.dtype == dtype
    assert not args["counts"].any(), "the scratch must be all zero again"
    assert torch.equal(_bits(got)[~touched], _bits(before)[~touched]), "an entry outside the history changed"
    torch.testing.assert_close(got.cpu().double()[touched], want[touched], rtol=tol, atol=1e-5)


CASES = [_mixed_rows, _long_history]


@pytest.mark.parametrize("make_case", CASES)
def test_apply_penalties_matches_vllm(backend, make_case):
    device, dtype, tol = backend
    from blink.models.kernels.penalties import CHUNK, apply_penalties

    assert LONG > 2 * CHUNK
    _check(apply_penalties, make_case(), device, dtype, tol)


@pytest.mark.parametrize("make_case", CASES)
def test_reference_apply_penalties_matches_vllm(make_case):
    _check(reference.apply_penalties, make_case(), "cpu", torch.float32, 1e-6)


def _assert_bfloat16_rounds_once(apply, device):
    """bf16 logits are read exactly and the float32 result is rounded once: as the float32 copy, rounded."""
    args = _inputs(_mixed_rows(), device, torch.bfloat16)
    copy = dict(args, logits=args["logits"].float(), counts=args["counts"].clone())
    apply(**args)
    apply(**copy)
    assert torch.equal(_bits(args["logits"]), _bits(copy["logits"].bfloat16()))


def test_bfloat16_logits_round_the_float32_result_once(backend):
    device, _, _ = backend
    if device == "cpu":
        pytest.skip("the interpreter's float32 -> bfloat16 cast truncates; compiled, it rounds to nearest even")
    from blink.models.kernels.penalties import apply_penalties

    _assert_bfloat16_rounds_once(apply_penalties, device)


def test_reference_bfloat16_logits_round_the_float32_result_once():
    _assert_bfloat16_rounds_once(reference.apply_penalties, "cpu")

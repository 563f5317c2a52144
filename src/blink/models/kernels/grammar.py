"""Grammar masks in Triton, applied in place to a step's logits; reference: ``reference.apply_grammar``.

Program ``(row, chunk)`` covers ``BLOCK`` token ids of one row: it reads the row's grammar state, and where the row has
one (``state >= 0``) loads the state's mask words for its tokens and sets the logits of the tokens they do not allow to
``-inf``. A row without a grammar reads one word and writes nothing, so the pass costs the step next to nothing while
no request asks for a structure; no host read, so it runs inside the captured step graph. ``grammars`` is the
scheduler's mirror of the ring's grammars region in device memory: a masked row reads ``ceil(V / 32)`` words of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous

BLOCK = 2048


@triton.jit
def _grammar_kernel(logits_ptr, grammars_ptr, state_ptr, vocab, logits_stride, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    wait_for_previous(PDL)
    token = chunk * BLOCK + tl.arange(0, BLOCK)
    state = tl.load(state_ptr + row + tl.zeros([BLOCK], tl.int32))     # one word, the same address in every lane
    masked = (token < vocab) & (state >= 0)
    word = tl.load(grammars_ptr + state + token // 32, mask=masked, other=-1)
    refused = masked & (((word >> (token % 32)) & 1) == 0)
    minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + token, minus_inf, mask=refused)


def apply_grammar(logits: torch.Tensor, grammars: torch.Tensor, state: torch.Tensor) -> None:
    """Set to ``-inf``, in place, the logits of row ``r`` of ``logits [S, V]`` whose tokens the grammar state
    ``state[r]`` (int32) does not allow; rows with ``state[r] < 0`` are left as they are. A state is a word offset into
    ``grammars`` (int32, the scheduler's mirror of the ring's grammars region) where its token mask starts: bit
    ``t % 32`` of word ``t // 32`` allows token ``t`` (``blink.ring.grammar``)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    _grammar_kernel[(rows, triton.cdiv(vocab, BLOCK))](logits, grammars, state, vocab, logits.stride(0), BLOCK=BLOCK,
                                                       **pdl_args(logits.device))

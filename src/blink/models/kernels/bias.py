"""``logit_bias`` in Triton: per-row additive biases of chosen tokens; reference: ``reference.apply_logit_bias``.

One program per row reads the row's ``[max_logit_bias]`` (token, bias) pairs and rewrites the valid ones' logits in
place: one launch in the step's PDL chain, where the torch version (a gather and a scatter with fixed shapes) is about
a dozen small operations outside it. A row's valid ids are distinct, so no two lanes write one logit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous


@triton.jit
def _logit_bias_kernel(logits_ptr, ids_ptr, bias_ptr, count_ptr, vocab, width, logits_stride, ids_stride,
                       bias_stride, WIDTH_P2: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, WIDTH_P2)
    # The pairs are step buffers: read before the wait.
    count = tl.load(count_ptr + row)
    ids = tl.load(ids_ptr + row * ids_stride + j, mask=j < width, other=-1)
    bias = tl.load(bias_ptr + row * bias_stride + j, mask=j < width, other=0.0)
    valid = (j < count) & (ids >= 0) & (ids < vocab)  # past the width ids read as -1
    wait_for_previous(PDL)
    at = logits_ptr + row * logits_stride + tl.where(valid, ids, 0)
    x = tl.load(at, mask=valid, other=0.0).to(tl.float32)
    tl.store(at, (x + bias).to(logits_ptr.dtype.element_ty), mask=valid)


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor, count: torch.Tensor) -> None:
    """As ``reference.apply_logit_bias``: ``logits [S, V]`` with unit stride in V, in place."""
    rows, width = ids.shape
    if width == 0:  # a ring without logit_bias
        return
    if logits.stride(1) != 1 or ids.stride(1) != 1 or bias.stride(1) != 1:
        raise ValueError("apply_logit_bias reads logits, ids and biases at unit stride along a row")
    _logit_bias_kernel[(rows,)](logits, ids, bias, count, logits.shape[1], width, logits.stride(0), ids.stride(0),
                                bias.stride(0), WIDTH_P2=triton.next_power_of_2(width), **pdl_args(logits.device))

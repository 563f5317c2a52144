"""The fused MoE kernels against the torch reference: routing, the expert-sorted block-aligned layout (uneven loads,
empty experts, both block sizes) and the whole MLP, on router logits whose order is unambiguous in any dtype."""
import pytest
import torch

from blink.models.kernels import reference
from tests.models.kernels.conftest import rel_err

# (tokens, experts, top_k, renormalize): decode- and prefill-sized blocks, Qwen3-30B-A3B's 128 experts top-8, and
# more entries than one chunk of the align kernel (moe.MAX_CHUNK)
CASES = [(37, 8, 2, False), (300, 8, 2, True), (6, 128, 8, True), (1100, 8, 2, True)]


def skewed_router_logits(tokens: int, experts: int, device, dtype) -> torch.Tensor:
    """Distinct per row and exact in bf16 (multiples of 4 / experts), so every dtype ranks them alike. Experts 0 and 1
    rank first for two thirds of the tokens; experts 5 and 6 rank last for all, so with ``top_k <= experts - 2`` they
    get no token."""
    score = torch.rand(tokens, experts)
    score[: 2 * tokens // 3, :2] += 2
    score[:, 5:7] -= 2
    rank = score.argsort(1).argsort(1).float()
    return (rank * (4 / experts) - 2).to(device, dtype)


@pytest.mark.parametrize("tokens, experts, top_k, renormalize", CASES)
def test_route_matches_reference(backend, tokens, experts, top_k, renormalize):
    device, dtype, tol = backend
    logits = skewed_router_logits(tokens, experts, device, dtype)
    from blink.models.kernels.moe import route

    weights, ids = route(logits, top_k, renormalize)
    ref_weights, ref_ids = reference.route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref_ids)
    assert weights.dtype == dtype and rel_err(weights, ref_weights) < tol


@pytest.mark.parametrize("tokens, experts, top_k, renormalize", CASES)
def test_align_lays_entries_out_in_expert_blocks(backend, tokens, experts, top_k, renormalize):
    device, dtype, _ = backend
    ids = reference.route(skewed_router_logits(tokens, experts, device, dtype), top_k, renormalize)[1].int()
    from blink.models.kernels.moe import align, tiles_for

    n, block_m = ids.numel(), tiles_for(ids.numel(), experts).block_m
    sorted_entries, expert_blocks, total = align(ids, experts, block_m)
    counts = torch.bincount(ids.flatten().long(), minlength=experts).cpu()
    assert counts[5] == counts[6] == 0 and counts[0] >= 2 * tokens // 3 > counts[2:].max()  # uneven, some empty
    padded = (counts + block_m - 1) // block_m * block_m
    assert total.item() == padded.sum() <= sorted_entries.numel()
    layout = sorted_entries[:total.item()].cpu().long()
    blocks = torch.repeat_interleave(torch.arange(experts), padded // block_m)
    assert torch.equal(expert_blocks[:len(blocks)].cpu().long(), blocks)
    flat = ids.flatten().cpu().long()
    begin = 0
    for e in range(experts):  # each expert: its entries in ascending order, then padding (entry id n)
        want = torch.nonzero(flat == e)[:, 0]
        got = layout[begin:begin + padded[e]]
        assert torch.equal(got[:counts[e]], want) and torch.all(got[counts[e]:] == n), e
        begin += padded[e]


@pytest.mark.parametrize("tokens, experts, top_k, renormalize", CASES)
def test_fused_moe_matches_reference(backend, tokens, experts, top_k, renormalize):
    device, dtype, tol = backend
    hidden, inter = 96, 80  # neither a multiple of the 64-wide tiles
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, device=device, dtype=dtype) * inter ** -0.5
    logits = skewed_router_logits(tokens, experts, device, dtype)
    from blink.models.kernels.moe import fused_moe

    out = fused_moe(x, logits, gate_up, down, top_k, renormalize)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, reference.fused_moe(x, logits, gate_up, down, top_k, renormalize)) < tol


@pytest.mark.parametrize("tiles", [dict(block_m=16, block_n=32, block_k=128, num_warps=8, num_stages=2),
                                   dict(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=4)])
def test_fused_moe_matches_reference_with_other_tiles(backend, tiles):
    """The launch shapes ``bench/moe_bench.py --sweep`` tries compute the same MLP."""
    device, dtype, tol = backend
    from blink.models.kernels.moe import Tiles, moe_experts, route

    tokens, experts, top_k, hidden, inter = 37, 8, 2, 96, 80
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, device=device, dtype=dtype) * inter ** -0.5
    logits = skewed_router_logits(tokens, experts, device, dtype)
    out = moe_experts(x, *route(logits, top_k, True), gate_up, down, Tiles(**tiles))
    assert rel_err(out, reference.fused_moe(x, logits, gate_up, down, top_k, True)) < tol


def test_tiles_name_the_bad_field():
    from blink.models.kernels.moe import Tiles

    with pytest.raises(ValueError, match="Tiles.block_n must be a power of two >= 16"):
        Tiles(block_m=16, block_n=48)
    with pytest.raises(ValueError, match="Tiles.num_warps must be"):
        Tiles(block_m=16, num_warps=3)

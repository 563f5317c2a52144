"""Paged attention over mixed batches: decodes with long prefixes, prefill chunks on cached prefixes, GQA groups
that are not powers of two, sliding windows, several KV splits, and padding rows."""
import random

import pytest
import torch

from blink.device.step import StepBuffers, StepLayout
from blink.models.batch import SeqChunk, chunk_drafts, fill_step
from blink.models.kernels import reference
from tests.models.kernels.conftest import rel_err

PAGE = 16


def _batch(device, q_lens_and_prefixes, pages=64, seed=0):
    rng = random.Random(seed)
    free = list(range(pages))
    rng.shuffle(free)
    chunks = []
    for q_len, prefix in q_lens_and_prefixes:
        n_pages = -(-(q_len + prefix) // PAGE)
        chunks.append(SeqChunk([1] * q_len, prefix, [free.pop() for _ in range(n_pages)]))
    buf = StepBuffers(StepLayout(256, 256, 32), device)
    return buf, fill_step(buf, chunks, PAGE)


@pytest.mark.parametrize("heads, kv_heads, window, splits, seqs", [
    (8, 2, 0, 1, [(1, 300), (1, 17), (1, 0), (1, 64)]),            # decodes
    (8, 2, 0, 4, [(1, 300), (1, 17), (1, 0), (1, 64)]),            # decodes, split KV
    (8, 2, 0, 16, [(1, 500), (1, 300), (1, 0)]),                   # decodes, 16 KV splits, 8 of them with keys
    (9, 3, 0, 1, [(37, 0), (1, 90), (20, 45), (5, 11)]),           # mixed, group of 3
    (9, 3, 0, 2, [(37, 0), (1, 90), (20, 45), (5, 11)]),
    (4, 4, 24, 8, [(40, 10), (1, 100), (3, 60)]),                   # sliding window, MHA
    (16, 1, 0, 1, [(70, 33)]),                                      # MQA, one long chunk
])
def test_paged_attention_matches_reference(backend, heads, kv_heads, window, splits, seqs):
    device, dtype, tol = backend
    dim = 64
    buf, n = _batch(device, seqs)
    bucket = n + 5  # padding rows must come out 0
    q = torch.randn(bucket, heads * 3, dim, device=device, dtype=dtype)[:, :heads]  # a strided view, as in a step
    cache = torch.randn(2, 64, PAGE, kv_heads, dim, device=device, dtype=dtype)
    from blink.models.kernels.attention import attention, attention_plan

    plan = attention_plan(buf, bucket, heads, kv_heads, dim, PAGE, dtype, num_splits=splits)
    out = attention(q, cache, plan, dim ** -0.5, window)
    ref = reference.attention(q, cache, reference.attention_plan(buf, bucket, heads, kv_heads, dim, PAGE), dim ** -0.5,
                              window)
    assert rel_err(out, ref) < tol
    assert torch.all(out[n:] == 0)


def _block_owner(qsl, num_seqs, num_rows, block_q, block):
    """``_attention_kernel``'s map from a query block to (sequence, its local block), in Python; None: it exits."""
    extra = block - num_rows
    if extra < 0:
        seq = block if block < num_seqs else -1
    else:
        seq = max((i for i in range(num_seqs) if qsl[i] // block_q <= extra), default=-1)
    if seq < 0:
        return None
    q_len = qsl[seq + 1] - qsl[seq]
    local = -(-q_len // block_q) - 1 - (0 if extra < 0 else 1 + extra - qsl[seq] // block_q)
    return (seq, local) if local >= 0 else None


@pytest.mark.parametrize("block_q", [1, 4, 16])
def test_the_launch_grid_covers_each_query_block_once(block_q):
    """Every query block of every sequence, empty rows (a verification's) and ragged chunks included, is one program's
    in the ``T // BLOCK_Q + S`` a bucket launches, and no program's twice."""
    rng = random.Random(block_q)
    for _ in range(200):
        lens = [rng.choice([0, 0, 1, 1, 5, rng.randint(1, 70)]) for _ in range(rng.randint(1, 12))]
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        rows = len(lens) + rng.randint(0, 3)              # the bucket's rows: past num_seqs they are empty
        tokens = max(qsl[-1] + rng.randint(0, 9), rows)   # the bucket's tokens: past qsl[num_seqs] padding
        owners = [_block_owner(qsl, len(lens), rows, block_q, b) for b in range(tokens // block_q + rows)]
        live = sorted(o for o in owners if o is not None)
        assert live == [(i, j) for i, n in enumerate(lens) for j in range(-(-n // block_q))], (lens, rows, tokens)


def test_default_plan_splits_decode_buckets_only(backend):
    device, dtype, _ = backend
    buf, _ = _batch(device, [(1, 10)])
    from blink.models.kernels.attention import attention_plan

    assert attention_plan(buf, 1, 32, 1, 128, PAGE, dtype).num_splits > 1
    assert attention_plan(buf, 256, 32, 8, 128, PAGE, dtype).num_splits == 1


@pytest.mark.parametrize("tiles", [dict(query_rows=32, block_n=32, num_warps=8, num_stages=2),
                                   dict(query_rows=128, block_n=128, num_warps=8, num_stages=4)])
def test_paged_attention_matches_reference_with_other_tiles(backend, tiles):
    """Launch shapes other than the defaults (the ones bench/attention_bench.py --sweep times): blocks of several
    and of one query token, key blocks shorter and longer than a sequence, split KV."""
    device, dtype, tol = backend
    heads, kv_heads, dim = 8, 2, 64
    buf, n = _batch(device, [(37, 0), (1, 90), (20, 45), (5, 11), (1, 0)])
    q = torch.randn(n, heads, dim, device=device, dtype=dtype)
    cache = torch.randn(2, 64, PAGE, kv_heads, dim, device=device, dtype=dtype)
    from blink.models.kernels.attention import Tiles, attention, attention_plan

    for splits in (1, 2):
        plan = attention_plan(buf, n, heads, kv_heads, dim, PAGE, dtype, num_splits=splits, tiles=Tiles(**tiles))
        assert plan.block_q == tiles["query_rows"] // (heads // kv_heads)
        out = attention(q, cache, plan, dim ** -0.5)
        ref = reference.attention(q, cache, reference.attention_plan(buf, n, heads, kv_heads, dim, PAGE), dim ** -0.5)
        assert rel_err(out, ref) < tol, splits


def test_tiles_name_the_bad_field():
    from blink.models.kernels.attention import Tiles, tiles_for

    with pytest.raises(ValueError, match="Tiles.query_rows must be a power of two >= 16"):
        Tiles(query_rows=8)
    with pytest.raises(ValueError, match="Tiles.block_n must be a power of two >= 16"):
        Tiles(query_rows=16, block_n=96)
    with pytest.raises(ValueError, match="Tiles.num_stages must be a positive int"):
        Tiles(query_rows=16, num_stages=0)
    assert tiles_for(256, 256) == Tiles(16, num_stages=3) and tiles_for(512, 256) == Tiles(64)
    # Where a decoding sequence may bring drafts, a decode-sized bucket takes the prefill blocks.
    assert tiles_for(320, 512, 5) == Tiles(64) and tiles_for(16, 512, 2) == Tiles(64)


def test_a_bucket_past_the_launch_grid_is_refused_with_what_to_do():
    """Query blocks are the launch grid's second dimension (at most 65535): one-token blocks of a 65536-token bucket
    do not fit, four-token blocks do."""
    pytest.importorskip("triton")
    from blink.models.kernels.attention import Tiles, attention_plan

    buf = StepBuffers(StepLayout(65536, 256, 32), "cpu")
    with pytest.raises(ValueError, match="65792 query blocks of 1 tokens exceed the launch grid's 65535: use larger "
                                         "Tiles.query_rows"):
        attention_plan(buf, 65536, 16, 1, 16, PAGE, torch.bfloat16, num_splits=1, tiles=Tiles(16))
    plan = attention_plan(buf, 65536, 16, 1, 16, PAGE, torch.bfloat16, num_splits=1, tiles=Tiles(64))
    assert (plan.block_q, plan.num_blocks) == (4, 65536 // 4 + 256)


@pytest.mark.parametrize("decode_query_len", [1, 5])
def test_a_sequence_verifying_drafts_attends_as_one_chunk(backend, decode_query_len):
    """Rows ``i .. i + k`` holding one sequence's last token and ``k`` drafts, one token each, give the same output
    through attention's view (one chunk in row ``i``, the others empty: ``step.py``) as each row attending alone,
    a chunk longer than a query block (4 tokens, where the layout plans for no drafts) and one whose drafts open a
    page included; with ``StepLayout.decode_query_len`` 5 one query block holds the longest chunk."""
    device, dtype, tol = backend
    heads, kv_heads, dim = 8, 2, 64
    rng = random.Random(5)
    free = list(range(64))
    rng.shuffle(free)
    groups = [(300, 5), (17, 1), (64, 3), (5, 2)]     # (context before the last token, rows: last token + drafts)
    chunks, spans = [], []
    for context, rows in groups:
        pages = [free.pop() for _ in range(-(-(context + rows) // PAGE))]
        spans.append((len(chunks), len(chunks) + rows))
        chunks += [SeqChunk([1], context + j, pages) for j in range(rows)]
    buf = StepBuffers(StepLayout(256, 256, 32, decode_query_len=decode_query_len), device)
    n = fill_step(buf, chunks, PAGE)
    q = torch.randn(n, heads, dim, device=device, dtype=dtype)
    cache = torch.randn(2, 64, PAGE, kv_heads, dim, device=device, dtype=dtype)
    from blink.models.kernels.attention import attention, attention_plan

    alone = reference.attention(q, cache, reference.attention_plan(buf, n, heads, kv_heads, dim, PAGE), dim ** -0.5)
    chunk_drafts(buf, spans)
    assert [int(buf.attn_seq_lens[first]) for first, _ in spans] == [context + rows for context, rows in groups]
    assert all(buf.attn_seq_lens[first + 1:end].sum() == 0 for first, end in spans)
    buf.seq_lens.zero_()             # the rows' own view is not attention's: it must not be read
    for splits in (1, 4):
        plan = attention_plan(buf, n, heads, kv_heads, dim, PAGE, dtype, num_splits=splits)
        assert plan.block_q == (4 if decode_query_len == 1 else 16)
        assert rel_err(attention(q, cache, plan, dim ** -0.5), alone) < tol, splits
    grouped = reference.attention(q, cache, reference.attention_plan(buf, n, heads, kv_heads, dim, PAGE), dim ** -0.5)
    assert rel_err(grouped, alone) < tol


def test_paged_attention_reads_an_e4m3_pool(backend):
    """An FP8 KV cache: the kernel upcasts K and V exactly, as the reference does."""
    device, dtype, tol = backend
    from blink.models.e4m3 import FP8
    from blink.models.kernels.attention import attention, attention_plan

    heads, kv_heads, dim = 8, 2, 64
    buf, n = _batch(device, [(1, 300), (20, 45), (1, 0), (37, 0)])
    q = torch.randn(n, heads, dim, device=device, dtype=dtype)
    cache = torch.randn(2, 64, PAGE, kv_heads, dim, device=device).to(FP8)
    out = attention(q, cache, attention_plan(buf, n, heads, kv_heads, dim, PAGE, dtype), dim ** -0.5)
    ref = reference.attention(q, cache, reference.attention_plan(buf, n, heads, kv_heads, dim, PAGE), dim ** -0.5)
    assert rel_err(out, ref) < tol

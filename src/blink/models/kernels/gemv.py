"""One-row projections of small bf16 weights: a GEMV that streams its weights through shared memory, its first
copies before its PDL wait, and lets the kernel after it launch as it starts.

At one row a projection's time is its weight bytes plus its ramp, and for a small model's few-MB projections the ramp
is most of it. Here each program streams ``BLOCK_N`` weight rows through ``STAGES`` shared-memory tiles of
``BLOCK_K`` columns by cp.async (Ampere's asynchronous copy, in Triton's Gluon), issues its first ``STAGES`` copies
before its PDL wait (weights only, as ``pdl``'s invariants allow) and lets its dependents launch as it starts
(``griddepcontrol.launch_dependents``), so the kernel after it is placed while it runs. Its first ``STAGES *
BLOCK_K`` columns (all of them up to K = 1024) then stream while the kernel before it runs only where that kernel
triggers too (a chain of GEMVs); in the step the kernels before a projection (norms, SiLU, attention's merge) do not
(``pdl``), so there the gain is the GEMV's own speed and the early placement of the kernel after it.

On an H200 (branch ``try/gluon-gemv``, raw ``bench/results/gemv_step_h200_856d13f.json``), Qwen3-0.6B's decode step
at one row took 0.905-0.908 ms against the skinny GEMM's 1.064-1.065 (its 112 projections 500 against 618 us);
Llama-3.2-1B's 0.968-0.977 against 1.008-1.012 with the GEMV on its projections of at most 16 MiB (qkv and o_proj,
12 and 8 MiB). With every projection on it, Llama-3.2-1B's step took 13 % longer and Qwen3-8B's 13 % (the skinny
GEMM's ``tl.dot`` and split reduction stream large weights faster), hence ``MAX_WEIGHT_BYTES``.
``bench/experiments/smem_prefetch_bench.py`` measured the parts on an H100 (a chain of Qwen3-0.6B's projections:
skinny 23.2 us a layer, GEMV 19.4, GEMV with its dependents triggered 16.8; the copies before or after the wait
alike without the trigger).

Gluon is experimental and renames its calls: the asynchronous copy and the block's barrier are ``async_load`` and
``barrier`` in Triton 3.9, ``async_copy_global_to_shared`` and ``thread_barrier`` in 3.6 (the GPU image's); the kernel
takes whichever its Triton has, and compiles with both. ``griddepcontrol`` needs Hopper: elsewhere, or with
``BLINK_PDL=0``, ``linear`` keeps the skinny GEMM. Reference: ``F.linear``.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .pdl import pdl_enabled
from .skinny import TARGET_PROGRAMS

BLOCK_K = 256               # columns a stage: 32 lanes x 8 bf16 (16-byte copies)
STAGES = 4
NUM_WARPS = 4
MAX_WEIGHT_BYTES = 12 << 20  # up to Qwen3-0.6B's gate_up and Llama-3.2-1B's qkv (12 MiB each), where it was measured
MIN_K = 2 * BLOCK_K          # Triton 3.6 fails to compile a loop of one stage (an LLVM assertion in its lowering)
# Gluon's names in Triton 3.9, else 3.6's (the module docstring).
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _grid_dependency(op: gl.constexpr):
    """PTX ``griddepcontrol.<op>`` (Gluon has no call of its own for it): an asm statement with a dummy output."""
    gl.inline_asm_elementwise(f"griddepcontrol.{op}; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def start_weight_ring(w_ptr, K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      COPY_BEFORE_WAIT: gl.constexpr, TRIGGER: gl.constexpr, layout: gl.constexpr,
                      shared: gl.constexpr):
    """A program's prologue: trigger its dependents (``TRIGGER``), allocate the ring of ``STAGES`` shared tiles of
    its ``BLOCK_N`` weight rows and start their first copies, one commit group per stage (empty past the last step),
    before or after the PDL wait. Returns the ring and the tiles' addresses (``layout``); ``refill_weight_ring``
    keeps it streaming."""
    if TRIGGER:
        _grid_dependency("launch_dependents")
    rows = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    tiles = w_ptr + rows.to(gl.int64)[:, None] * K + cols[None, :]
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], shared)
    if not COPY_BEFORE_WAIT:
        _grid_dependency("wait")
    for s in gl.static_range(STAGES):           # weights only before the wait
        if s < K // BLOCK_K:
            _async_load(ring.index(s), tiles + s * BLOCK_K)
        async_copy.commit_group()
    if COPY_BEFORE_WAIT:
        _grid_dependency("wait")
    return ring, tiles


@gluon.jit
def refill_weight_ring(ring, tiles, i, K: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """After step ``i`` read its stage (every thread: a barrier before this): that stage takes step
    ``i + STAGES``'s tile, one commit group either way, so ``wait_group(STAGES - 1)`` finds step i + 1's landed."""
    if i + STAGES < K // BLOCK_K:
        _async_load(ring.index(i % STAGES), tiles + (i + STAGES) * BLOCK_K)
    async_copy.commit_group()


@gluon.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 STAGES: gl.constexpr, COPY_BEFORE_WAIT: gl.constexpr, TRIGGER: gl.constexpr,
                 num_warps: gl.constexpr):
    """``y[tile] = w[tile] @ x`` for ``BLOCK_N`` rows of ``w [N, K]`` (K a multiple of ``BLOCK_K``). ``gemv`` sets
    ``COPY_BEFORE_WAIT`` and ``TRIGGER``; ``smem_prefetch_bench`` times each without the other."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ring, tiles = start_weight_ring(w_ptr, K, BLOCK_N, BLOCK_K, STAGES, COPY_BEFORE_WAIT, TRIGGER, layout,
                                    gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    for i in range(K // BLOCK_K):
        async_copy.wait_group(STAGES - 1)       # this thread's copies of step i have landed ...
        _barrier()                              # ... and every thread's
        w = ring.index(i % STAGES).load(layout).to(gl.float32)
        x = gl.load(x_ptr + i * BLOCK_K + cols).to(gl.float32)
        acc += w * x[None, :]
        _barrier()                              # every thread has read the stage before it is refilled
        refill_weight_ring(ring, tiles, i, K, BLOCK_K, STAGES)
    rows = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    gl.store(y_ptr + rows, gl.sum(acc, axis=1).to(gl.bfloat16))


def block_n_for(n: int) -> int:
    """Rows per program: at least ``TARGET_PROGRAMS`` programs, 4 to 16 rows each (4: one a warp; 16: its
    accumulator, a float32 per weight entry of a stage, 32 registers a thread)."""
    return min(16, max(4, triton.next_power_of_2(triton.cdiv(n, TARGET_PROGRAMS))))


def gemv_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` computes ``x @ weight.T``: one contiguous bf16 row on a GPU that launches with PDL, bf16
    weights of at most ``MAX_WEIGHT_BYTES`` stored row by row, K a multiple of ``BLOCK_K`` and at least ``MIN_K``,
    N a multiple of the rows a program takes."""
    n, k = weight.shape
    return (pdl_enabled(x.device) and x.shape[0] == 1 and x.dtype == weight.dtype == torch.bfloat16
            and x.stride(-1) == 1 and weight.stride() == (k, 1) and n * k * weight.element_size() <= MAX_WEIGHT_BYTES
            and k % BLOCK_K == 0 and k >= MIN_K and n % block_n_for(n) == 0)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [1, K] @ weight [N, K].T`` → ``[1, N]`` in bf16 (``gemv_takes`` must hold)."""
    if not gemv_takes(x, weight):
        raise ValueError(f"gemv takes one contiguous bf16 row on a GPU with PDL and bf16 weights of at most "
                         f"{MAX_WEIGHT_BYTES} bytes, K a multiple of {BLOCK_K} from {MIN_K} (got x {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}, weight {tuple(weight.shape)} {weight.dtype}): use linear")
    return launch_gemv(x, weight)


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, copy_before_wait: bool = True,
                trigger: bool = True) -> torch.Tensor:
    """``gemv`` where the caller has checked ``gemv_takes`` (``linear``: once per projection, not twice);
    ``smem_prefetch_bench`` turns the copies before the wait and the trigger off one at a time."""
    n, k = weight.shape
    out = torch.empty((1, n), device=x.device, dtype=x.dtype)
    block_n = block_n_for(n)
    _gemv_kernel[(n // block_n,)](weight, x, out, K=k, BLOCK_N=block_n, BLOCK_K=BLOCK_K, STAGES=STAGES,
                                  COPY_BEFORE_WAIT=copy_before_wait, TRIGGER=trigger, num_warps=NUM_WARPS,
                                  launch_pdl=True)
    return out

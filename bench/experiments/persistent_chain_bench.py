"""Does one persistent kernel stream a decode layer's weights closer to the HBM floor than a chain of GEMM kernels?
An experiment for issue 4 (the step at <= 1.10x its floor), not a step kernel.

The decode step at batches 1-16 loses most of its time to fixed costs per kernel: each of Llama-3-8B's small GEMMs
takes 3-6 us beyond its weight bytes' floor in ramp and tail (cuBLAS and Triton alike:
``bench/experiments/gemv_bench.py``), and PDL did not hide them (``bench/experiments/decode_chain_bench.py``). A
persistent kernel keeps every SM busy across GEMM boundaries: one program per SM walks the ops in order, takes the
output tiles ``pid, pid + P, ...`` of each, and waits at a grid barrier (an atomic counter, release/acquire at GPU
scope) before the next op reads what this one wrote.

The chain is ``LAYERS`` of Llama-3-8B's MLP-and-projection GEMMs at M rows: qkv (4096 -> 6144), o_proj (the first
4096 columns of qkv's output -> 4096), gate_up with SiLU-mul (4096 -> 2 x 14336 -> 14336), down (14336 -> 4096,
added to the layer's input as the residual); attention, RoPE and the norms are left out (they are what the GEMMs
would wrap). Timed as:

- ``cublas``: ``torch.nn.functional.linear`` per GEMM plus blink's SiLU-mul kernel, captured in one CUDA graph;
- ``persistent``: the kernel below at each launch shape of ``SHAPES``, the counter zeroed in the same graph.

Both are checked against a float64 chain: the relative error of what the layers added to the input is < 0.1
(bf16 rounding of the residual stream alone makes ~0.03; a wrong tile makes ~1).
The floor is the layers' weight bytes at the measured copy rate.

Run: ``PYTHONPATH=src python3 -m bench.experiments.persistent_chain_bench [--out persistent_chain_bench.json]``
(``$OUT/...`` when set).
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.gpu_timing import graph_ms, kernel_bench_start, rel_err
from blink.models.kernels.activation import silu_and_mul

HIDDEN, QKV, INTER = 4096, 6144, 14336
LAYERS = 8
ROWS = (1, 16)
SHAPES = [dict(block_n=n, block_k=k, num_stages=s, per_sm=p, num_warps=w) for n, k, s, p, w in
          ((32, 256, 4, 1, 4), (64, 128, 4, 1, 4), (32, 256, 4, 2, 4), (64, 256, 3, 1, 8), (64, 256, 4, 1, 8),
           (32, 512, 3, 1, 8), (128, 128, 4, 1, 8), (32, 256, 3, 2, 8))]


@triton.jit
def _tile(src, ld_src, w, n, k, m, cols, rows, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """``src[:m, :k] @ w[cols, :k].T`` in float32 (activations through L2 only: other SMs wrote them)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(src + rows[:, None] * ld_src + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                    other=0.0, cache_modifier=".cg")
        wt = tl.load(w + cols[:, None].to(tl.int64) * k + ks[None, :], mask=(cols[:, None] < n) & (ks[None, :] < k),
                     other=0.0)
        acc += tl.dot(x, tl.trans(wt))
    return acc


@triton.jit
def _persistent_chain_kernel(ops_ptr, counter_ptr, m, num_ops, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """Op ``i`` is row ``i`` of ``ops [num_ops, 8]`` int64: weight, src, dst addresses, n, k, src row stride,
    gated (W holds n gate rows then n up rows; the output is silu(gate) * up), residual (dst += the product)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    for op in range(num_ops):
        row = ops_ptr + op * 8
        # Addresses and sizes loaded from memory carry no alignment facts; without them Triton neither vectorizes
        # nor pipelines the loads. Every entry is a multiple of 16 elements (checked by ``op_table``).
        w = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.bfloat16)), 16)
        src = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.bfloat16)), 16)
        dst = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.bfloat16)), 16)
        n, k = tl.multiple_of(tl.load(row + 3), 16), tl.multiple_of(tl.load(row + 4), 16)
        ld_src, gated, residual = tl.multiple_of(tl.load(row + 5), 16), tl.load(row + 6), tl.load(row + 7)
        for t in range(pid, tl.cdiv(n, BLOCK_N), programs):
            cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = _tile(src, ld_src, w, n, k, m, cols, rows, BLOCK_M, BLOCK_N, BLOCK_K)
            if gated != 0:
                up = _tile(src, ld_src, w + n * k, n, k, m, cols, rows, BLOCK_M, BLOCK_N, BLOCK_K)
                acc = acc * tl.sigmoid(acc) * up
            out = dst + rows[:, None] * n + cols[None, :]
            mask = (rows[:, None] < m) & (cols[None, :] < n)
            if residual != 0:
                acc += tl.load(out, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out, acc.to(tl.bfloat16), mask=mask)
        # Grid barrier: this program's stores, then its arrival (release); wait for every program's (acquire).
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release")
        target = (op + 1) * programs
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        tl.debug_barrier()


class Chain:
    """The layers' weights (bf16, ~N(0, 1/k); down 10x smaller, so the residual stream keeps its scale: SiLU-mul is
    quadratic) and activation buffers of ``m`` rows."""

    def __init__(self, m: int):
        def weight(n, k, scale=1.0):
            return (torch.randn(n, k, device="cuda") * scale * k ** -0.5).to(torch.bfloat16)

        self.m = m
        self.layers = [dict(qkv=weight(QKV, HIDDEN), o=weight(HIDDEN, HIDDEN), gate_up=weight(2 * INTER, HIDDEN),
                            down=weight(HIDDEN, INTER, 0.1)) for _ in range(LAYERS)]
        self.x0 = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.x = self.x0.clone()
        self.qkv = torch.empty(m, QKV, device="cuda", dtype=torch.bfloat16)
        self.o = torch.empty(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.act = torch.empty(m, INTER, device="cuda", dtype=torch.bfloat16)
        self.weight_bytes = sum(w.numel() * 2 for layer in self.layers for w in layer.values())

    def reference(self) -> torch.Tensor:
        x = self.x0.double()
        for layer in self.layers:
            qkv = x @ layer["qkv"].double().T
            o = qkv[:, :HIDDEN] @ layer["o"].double().T
            g, u = (o @ layer["gate_up"].double().T).chunk(2, dim=-1)
            x = x + (g * torch.sigmoid(g) * u) @ layer["down"].double().T
        return x

    def cublas(self):
        self.x.copy_(self.x0)
        for layer in self.layers:
            torch.matmul(self.x, layer["qkv"].T, out=self.qkv)
            torch.matmul(self.qkv[:, :HIDDEN], layer["o"].T, out=self.o)
            silu_and_mul(F.linear(self.o, layer["gate_up"]), out=self.act)
            self.x.addmm_(self.act, layer["down"].T)

    def op_table(self) -> torch.Tensor:
        ops = []
        for layer in self.layers:
            ops += [(layer["qkv"], self.x, self.qkv, QKV, HIDDEN, HIDDEN, 0, 0),
                    (layer["o"], self.qkv, self.o, HIDDEN, HIDDEN, QKV, 0, 0),
                    (layer["gate_up"], self.o, self.act, INTER, HIDDEN, HIDDEN, 1, 0),
                    (layer["down"], self.act, self.x, HIDDEN, INTER, INTER, 0, 1)]
        rows = [[w.data_ptr(), s.data_ptr(), d.data_ptr(), n, k, ld, g, r] for w, s, d, n, k, ld, g, r in ops]
        if any(v % 32 for row in rows for v in row[:3]) or any(v % 16 for row in rows for v in row[3:6]):
            raise ValueError("the kernel assumes 32-byte aligned tensors and sizes in multiples of 16 elements")
        return torch.tensor(rows, dtype=torch.int64, device="cuda")


SM_REGISTERS, SM_SHARED, BLOCK_RESERVED = 65536, 233472, 1024  # per H100/H200 SM


def resident_programs(block_n: int, block_k: int, num_stages: int, per_sm: int, num_warps: int) -> int:
    """How many programs of this shape fit one SM at once (registers and shared memory), compiled without a launch:
    a grid barrier with programs that cannot all be resident never returns."""
    kernel = _persistent_chain_kernel.warmup(torch.int64, torch.int32, 1, 1, BLOCK_M=16, BLOCK_N=block_n,
                                             BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages, grid=(1,))
    kernel._init_handles()
    by_regs = SM_REGISTERS // max(1, kernel.n_regs * num_warps * 32)
    by_shared = SM_SHARED // (kernel.metadata.shared + BLOCK_RESERVED)
    return min(by_regs, by_shared)


def persistent(chain: Chain, ops: torch.Tensor, counter: torch.Tensor, block_n: int, block_k: int, num_stages: int,
               per_sm: int, num_warps: int):
    chain.x.copy_(chain.x0)
    counter.zero_()
    programs = torch.cuda.get_device_properties(0).multi_processor_count * per_sm
    _persistent_chain_kernel[(programs,)](ops, counter, chain.m, ops.shape[0], BLOCK_M=16, BLOCK_N=block_n,
                                          BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)


def barrier_cost(chain: Chain, ops: torch.Tensor, counter: torch.Tensor, reps: int) -> dict:
    """Time per op of the kernel on ``ops`` with every op cut to one 16x16 tile: the grid barrier and the op's
    bookkeeping alone."""
    tiny = ops.clone()
    tiny[:, 3:6] = 16
    shape = SHAPES[0]
    us = graph_ms(lambda: persistent(chain, tiny, counter, **shape), reps) * 1e3 / ops.shape[0]
    print(f"grid barrier: {us:.2f} us per op ({shape})", flush=True)
    return dict(variant="barrier", **shape, us_per_op=us)


def main():
    args, bw, _ = kernel_bench_start(__doc__, "persistent_chain_bench.json", reps=20, sweep=False)
    rows, wrong = [], []
    for m in ROWS:
        chain = Chain(m)
        want, floor_us = chain.reference(), chain.weight_bytes / bw * 1e6 / LAYERS
        chain.cublas()
        err = rel_err(chain.x - chain.x0, want - chain.x0.double())
        us = graph_ms(chain.cublas, args.reps) * 1e3 / LAYERS
        rows.append(dict(m=m, variant="cublas", rel_err=err, us_per_layer=us, floor_us=floor_us))
        print(f"m={m:2d} cublas      {us:7.2f} us/layer  floor {floor_us:6.2f}  x{us / floor_us:.2f}  "
              f"(rel err {err:.1e})", flush=True)
        ops, counter = chain.op_table(), torch.zeros(1, dtype=torch.int32, device="cuda")
        if m == ROWS[0]:
            rows.append(barrier_cost(chain, ops, counter, args.reps))
        for shape in SHAPES:
            try:
                resident = resident_programs(**shape)
            except triton.runtime.errors.OutOfResources as e:
                print(f"m={m:2d} persistent  {shape}: does not fit ({str(e).splitlines()[0]})", flush=True)
                continue
            if resident < shape["per_sm"]:
                print(f"m={m:2d} persistent  {shape}: only {resident} program(s) fit an SM", flush=True)
                continue
            persistent(chain, ops, counter, **shape)
            err = rel_err(chain.x - chain.x0, want - chain.x0.double())
            us = graph_ms(lambda shape=shape: persistent(chain, ops, counter, **shape), args.reps) * 1e3 / LAYERS
            rows.append(dict(m=m, variant="persistent", **shape, rel_err=err, us_per_layer=us, floor_us=floor_us))
            print(f"m={m:2d} persistent  {us:7.2f} us/layer  floor {floor_us:6.2f}  x{us / floor_us:.2f}  "
                  f"(rel err {err:.1e})  {shape}", flush=True)
            wrong += [(m, str(shape))] if not err < 0.1 else []
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=bw, rows=rows),
                  f, indent=2)
    if wrong:
        sys.exit(f"the persistent chain differs from float64 at {wrong}")


if __name__ == "__main__":
    main()

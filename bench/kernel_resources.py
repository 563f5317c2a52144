"""The step's Triton kernels as Hopper runs them: registers, stack frame and shared memory, from the compiler, on any
machine (no GPU needed).

``python -m bench.kernel_resources [--models qwen3-8b qwen3-30b-a3b] [--layouts bf16 fp8 fp8-block fp8kv]
[--batches 1 16 32 64 256] [--context 1024] [--prefill 512] [--json PATH]`` builds each model with one layer of
each kind it has (dense, MoE) at its real widths on the CPU and runs its step on the CUDA ops (``triton_ops``) for
each decode batch and one prefill, under a Triton driver that compiles for sm_90 and launches nothing
(``CompileOnly``). So every kernel is compiled as the step would launch it there: the same argument dtypes and
alignment, the constexprs its launch shape picks, PDL on. It prints each distinct compile's registers, stack frame
(spills live there), shared memory and float conversion instructions (SASS ``F2F``/``F2FP``: in the JSON by opcode),
and exits 1 if a kernel fails to compile or has a stack frame.

Nothing is computed (no kernel runs; the outputs are whatever memory held): this is what the kernels cost, not what
they return. Triton is the installed one, which may differ from the GPU machine's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted (read when the kernels are decorated)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from bench import tree_commit  # noqa: E402
from bench.model_bench import LAYOUT, MODELS, PAGE, decode_chunks  # noqa: E402
from blink.device.step import StepBuffers  # noqa: E402
from blink.models import build_model  # noqa: E402
from blink.models.batch import SeqChunk, fill_step  # noqa: E402
from blink.models.kernels import attention, pdl, triton_ops  # noqa: E402
from blink.models.memory import kv_cache_dtype  # noqa: E402
from blink.models.quantization import Fp8Config  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 64)
HOPPER_SMS = 132
LAYOUTS = {"bf16": (None, "auto"), "fp8": (Fp8Config(), "auto"), "fp8-block": (Fp8Config((128, 128)), "auto"),
           "fp8kv": (Fp8Config(), "fp8")}
USAGE = re.compile(r"REG:(\d+) STACK:(\d+)")
CONVERSION = re.compile(r"\b(F2FP?\.[A-Z0-9_.]+)")


class CompileOnly:
    """Triton's active driver while the step runs: device 0 of an sm_90 target, no stream, no launch."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return HOPPER

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def compile_only(compiled: dict) -> None:
    """From now on in this process, every launch compiles its kernel for ``HOPPER``, zeroes its integer tensors (the
    indices a torch op may read next, which no kernel writes now) and returns without running; ``compiled`` gets
    each distinct compile once, keyed by the kernel's name and the compiled kernel."""
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.setdefault((self.fn.__name__, id(kernel)), kernel)
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, torch.Tensor) and not arg.is_floating_point():
                arg.zero_()
        return kernel

    JITFunction.run, pdl.pdl_enabled = compile_launch, lambda device: True
    attention.multiprocessors = lambda device: HOPPER_SMS  # attention splits as an H100's or H200's SMs take them
    driver.set_active(CompileOnly())


def usage(kernel) -> dict:
    """Registers a thread and stack frame bytes and the float conversion instructions (SASS ``F2F``/``F2FP``, which run
    below the full rate: ``kernels.widen``'s docstring) by opcode, as one ``cuobjdump`` of the cubin reads them; the
    shared memory Triton gives the kernel; its warps, stages and constexprs."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", "-sass", cubin.name],
                              capture_output=True, text=True, check=True).stdout
    registers, stack = (int(v) for v in USAGE.search(text).groups())
    conversions = Counter(CONVERSION.findall(text))
    return dict(registers=registers, stack_bytes=stack, conversions=dict(conversions),
                shared_bytes=kernel.metadata.shared,
                num_warps=kernel.metadata.num_warps, num_stages=kernel.metadata.num_stages,
                constants={kernel.src.fn.arg_names[path[0]]: v for path, v in kernel.src.constants.items()
                           if v is not None and not isinstance(v, str)})


def one_layer_of_each(name: str, layout: str):
    """The model at its real widths with one dense and/or one MoE layer (as many as its layers have kinds), built
    in its layout's dtypes (FP8 projections as a checkpoint stores them) with every weight one constant: no kernel
    reads the values, and drawing ~1.5 G random weights on the CPU took longer than compiling every kernel."""
    quantization, kv = LAYOUTS[layout]
    c = MODELS[name]
    kinds = {c.is_moe_layer(i) for i in range(c.num_layers)}
    config = replace(c, num_layers=len(kinds), quantization=quantization,
                     mlp_only_layers=(0,) if kinds == {True, False} else ())
    model = build_model(config, "cpu", torch.bfloat16)
    for p in model.parameters():
        p.data.fill_(0.02)
    model.ops = triton_ops
    return model, kv_cache_dtype(kv, model.dtype)


def run_steps(model, kv_dtype, batches: list[int], context: int, prefill: int) -> None:
    """The decode steps of ``batches`` sequences at ``context`` tokens and one ``prefill``-token chunk."""
    buf = StepBuffers(LAYOUT, "cpu")
    num_pages, prefill_pages = max(batches) * -(-context // PAGE), -(-prefill // PAGE)
    kv = model.allocate_kv_cache(max(num_pages, prefill_pages), PAGE, kv_dtype)
    for batch in batches:
        chunks, _ = decode_chunks(batch, context, num_pages, seed=batch)
        model(buf, kv, fill_step(buf, chunks, PAGE))
    if prefill:
        model(buf, kv, fill_step(buf, [SeqChunk(list(range(prefill)), 0, list(range(prefill_pages)))], PAGE))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"], choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 32, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows, compiled = [], {}
    compile_only(compiled)
    for name in args.models:
        for layout in args.layouts:
            compiled.clear()
            model, kv_dtype = one_layer_of_each(name, layout)
            with torch.no_grad():
                run_steps(model, kv_dtype, args.batches, args.context, args.prefill)
            rows += [dict(model=name, layout=layout, kernel=kernel_name, **usage(kernel))
                     for (kernel_name, _), kernel in compiled.items()]
    print(f"{'model':<14} {'layout':<9} {'kernel':<28} {'regs':>4} {'stack':>5} {'smem':>6} {'cvt':>4} warps  "
          f"constexprs")
    for r in sorted(rows, key=lambda r: (r["model"], r["layout"], r["kernel"], r["registers"])):
        consts = " ".join(f"{k}={v}" for k, v in r["constants"].items())
        print(f"{r['model']:<14} {r['layout']:<9} {r['kernel']:<28} {r['registers']:>4} {r['stack_bytes']:>5} "
              f"{r['shared_bytes']:>6} {sum(r['conversions'].values()):>4} {r['num_warps']:>5}  {consts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(commit=tree_commit(), triton=triton.__version__, target="sm_90", rows=rows), f, indent=1)
    spilled = [r for r in rows if r["stack_bytes"]]
    print(f"{len(rows)} compiles for sm_90 (Triton {triton.__version__}); {len(spilled)} with a stack frame")
    sys.exit(1 if spilled else 0)


if __name__ == "__main__":
    main()

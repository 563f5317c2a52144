"""What the scheduler's iteration waits for, one primitive at a time: fences, loads across PCIe, L2 round trips and
barriers, as one block of 256 threads sees them on this GPU. An experiment, not part of the loop.

The iteration (``blink/device/scheduler.py``) is mostly memory latency in a row, so its cost is a sum of these:

- ``fence_sc_sys``: ``__threadfence_system()`` (``fence.sc.sys``) after a store to host memory, as publish issues it;
  ``fence_acq_rel_sys``: ``fence.acq_rel.sys``, the lighter fence a release pattern (data, fence, flag) needs;
  ``fence_sc_gpu``: ``__threadfence()`` after a device-memory store, as the loop issues it before a launch.
- ``pcie_load``: one ``ld.global.cv`` of a word in host memory (a doorbell), per load of a dependent chain;
  ``pcie_loads_one_thread``: three by one thread, used only after all are issued; ``pcie_loads_three_warps``: one
  each by threads 0, 32 and 64, then a barrier (``doorbells.py``).
- ``scan_words``: 256 threads × 8 coalesced 4-byte ``ld.global.cv`` of host memory (2,048 state words) and a
  barrier, as ``waiting.collect`` reads the state column; ``scan_quads``: the same words as 16-byte loads (2 per
  thread).
- ``l2_load``: one load of a chain of dependent device-memory loads (L2 hits), the round trip each array access of
  the iteration costs; ``barrier``: ``__syncthreads()`` with 256 threads.

Thread 0 times each with ``clock64`` over ``REPS`` repetitions; medians, in cycles and in ns (the SM clock measured
against ``%globaltimer`` over the same kernel).

Run: ``PYTHONPATH=src python3 -m bench.experiments.hop_costs_bench [--out hop_costs_bench.json]``, or ``bash
bench/gpu_suite.sh experiment:hop_costs_bench``.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics

import numpy as np

from blink.device.driver import check

REPS = 200
THREADS = 256
WORDS = 2048                                    # host words the scans read: 8 per thread
CHAIN = 8                                       # dependent device loads per l2_load repetition
MEASURES = ("fence_sc_sys", "fence_acq_rel_sys", "fence_sc_gpu", "pcie_load", "pcie_loads_one_thread",
            "pcie_loads_three_warps", "scan_words", "scan_quads", "l2_load", "barrier")

SOURCE = r"""
#define REPS %(reps)d
#define WORDS %(words)d
#define CHAIN %(chain)d
#define MAGIC 0xDEADBEEFu
__device__ unsigned int ldcv(const unsigned int *p) {
  unsigned int v;
  asm volatile("ld.global.cv.u32 %%0, [%%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ uint4 ldcv4(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.cv.v4.u32 {%%0, %%1, %%2, %%3}, [%%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %%0, %%globaltimer;" : "=l"(t));
  return t;
}
// A branch on v: the thread waits for its load here, before the clock read or barrier that follows.
__device__ void wait_for(unsigned int v, unsigned int *sink) {
  if (v == MAGIC) sink[threadIdx.x] = v;
}
// out[m * REPS + rep]: cycles of measure m in repetition rep; then the kernel's cycles and ns.
// host[WORDS] holds WORDS: a chain of loads whose address is the value the last one read stays on that word.
extern "C" __global__ void hop_costs(unsigned int *host, const unsigned long long *chain, unsigned int *dev,
                                     long long *out, unsigned int *sink) {
  int tid = threadIdx.x;
  long long c0 = clock64();
  unsigned long long g0 = globaltimer();
  for (int rep = 0; rep < REPS; rep++) {
    int m = 0;
    long long t;
    __syncthreads();                                             // fence_sc_sys
    if (tid == 0) { host[WORDS + 1] = rep; t = clock64(); __threadfence_system(); out[m * REPS + rep] = clock64() - t; }
    m++;
    __syncthreads();                                             // fence_acq_rel_sys
    if (tid == 0) {
      host[WORDS + 1] = rep; t = clock64(); asm volatile("fence.acq_rel.sys;" ::: "memory");
      out[m * REPS + rep] = clock64() - t;
    }
    m++;
    __syncthreads();                                             // fence_sc_gpu
    if (tid == 0) { dev[0] = rep; t = clock64(); __threadfence(); out[m * REPS + rep] = clock64() - t; }
    m++;
    __syncthreads();                                             // pcie_load: a dependent chain, per load
    if (tid == 0) {
      unsigned int at = WORDS;
      t = clock64();
      for (int k = 0; k < CHAIN; k++) at = ldcv(host + at);
      wait_for(at, sink);
      out[m * REPS + rep] = (clock64() - t) / CHAIN;
    }
    m++;
    __syncthreads();                                             // pcie_loads_one_thread
    if (tid == 0) {
      t = clock64();
      unsigned int a = ldcv(host + WORDS), b = ldcv(host + WORDS + 2), c = ldcv(host + WORDS + 3);
      wait_for(a, sink); wait_for(b, sink); wait_for(c, sink);
      out[m * REPS + rep] = clock64() - t;
    }
    m++;
    __syncthreads();                                             // pcie_loads_three_warps
    t = clock64();
    if (tid == 0) wait_for(ldcv(host + WORDS), sink);
    if (tid == 32) wait_for(ldcv(host + WORDS + 2), sink);
    if (tid == 64) wait_for(ldcv(host + WORDS + 3), sink);
    __syncthreads();
    if (tid == 0) out[m * REPS + rep] = clock64() - t;
    m++;
    __syncthreads();                                             // scan_words
    t = clock64();
    {
      unsigned int v[8], sum = 0;
      for (int k = 0; k < 8; k++) v[k] = ldcv(host + k * THREADS_N + tid);
      for (int k = 0; k < 8; k++) sum += v[k];
      wait_for(sum, sink);
    }
    __syncthreads();
    if (tid == 0) out[m * REPS + rep] = clock64() - t;
    m++;
    __syncthreads();                                             // scan_quads
    t = clock64();
    {
      uint4 a = ldcv4((const uint4 *)host + tid), b = ldcv4((const uint4 *)host + THREADS_N + tid);
      wait_for(a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w, sink);
    }
    __syncthreads();
    if (tid == 0) out[m * REPS + rep] = clock64() - t;
    m++;
    __syncthreads();                                             // l2_load: a dependent chain, per load
    if (tid == 0) {
      unsigned long long at = 0;
      t = clock64();
      for (int k = 0; k < CHAIN; k++) at = *(volatile const unsigned long long *)(chain + at);
      wait_for((unsigned int)at, sink);
      out[m * REPS + rep] = (clock64() - t) / CHAIN;
    }
    m++;
    __syncthreads();                                             // barrier
    t = clock64();
    __syncthreads();
    if (tid == 0) out[m * REPS + rep] = clock64() - t;
  }
  if (tid == 0) {
    out[%(n_measures)d * REPS] = clock64() - c0;
    out[%(n_measures)d * REPS + 1] = (long long)(globaltimer() - g0);
  }
}
"""


def compile_kernel() -> bytes:
    """The experiment's cubin for this GPU (NVRTC)."""
    from cuda.bindings import driver, nvrtc

    device = check(driver.cuDeviceGet(0))
    attribute = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device))
    minor = check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device))
    source = (f"#define THREADS_N {THREADS}\n" + SOURCE % {"reps": REPS, "words": WORDS, "chain": CHAIN,
                                                          "n_measures": len(MEASURES)}).encode()
    program = check(nvrtc.nvrtcCreateProgram(source, b"hop_costs.cu", 0, [], []))
    options = [f"-arch=sm_{major}{minor}".encode()]
    if int(nvrtc.nvrtcCompileProgram(program, len(options), options)[0]) != 0:
        log = b" " * check(nvrtc.nvrtcGetProgramLogSize(program))
        nvrtc.nvrtcGetProgramLog(program, log)
        raise RuntimeError(f"NVRTC failed:\n{log.decode(errors='replace')}")
    cubin = b" " * check(nvrtc.nvrtcGetCUBINSize(program))
    nvrtc.nvrtcGetCUBIN(program, cubin)
    return cubin


def run() -> dict:
    from cuda.bindings import driver

    check(driver.cuInit(0))
    context = check(driver.cuDevicePrimaryCtxRetain(check(driver.cuDeviceGet(0))))
    check(driver.cuCtxSetCurrent(context))
    module = check(driver.cuModuleLoadData(compile_kernel()))
    kernel = check(driver.cuModuleGetFunction(module, b"hop_costs"))
    host_bytes = 4 * (WORDS + 4)
    host = check(driver.cuMemHostAlloc(host_bytes, driver.CU_MEMHOSTALLOC_DEVICEMAP))
    words = np.frombuffer((ctypes.c_uint32 * (WORDS + 4)).from_address(int(host)), np.uint32)
    words[:] = 0
    words[WORDS] = WORDS                        # the PCIe chain's word points at itself
    host_device = check(driver.cuMemHostGetDevicePointer(host, 0))
    # A random cycle over 4,096 words 64 bytes apart: each hop is a load that depends on the last, in L2.
    order = np.random.default_rng(0).permutation(4096)
    chain = np.zeros(4096 * 8, np.uint64)
    chain[order * 8] = np.roll(order, -1) * 8
    buffers = {name: check(driver.cuMemAlloc(size)) for name, size in
               (("chain", chain.nbytes), ("dev", 64), ("out", 8 * (len(MEASURES) * REPS + 2)), ("sink", 4 * THREADS))}
    check(driver.cuMemcpyHtoD(buffers["chain"], chain.ctypes.data, chain.nbytes))
    values = (int(host_device), *(int(buffers[name]) for name in ("chain", "dev", "out", "sink")))
    params = (values, (ctypes.c_void_p,) * len(values))
    out = np.zeros(len(MEASURES) * REPS + 2, np.int64)
    for _ in range(2):                          # the first run warms the caches and the clocks
        check(driver.cuLaunchKernel(kernel, 1, 1, 1, THREADS, 1, 1, 0, 0, params, 0))
        check(driver.cuCtxSynchronize())
    check(driver.cuMemcpyDtoH(out.ctypes.data, buffers["out"], out.nbytes))
    cycles_per_ns = out[-2] / out[-1]
    rows = {}
    for m, name in enumerate(MEASURES):
        median = statistics.median(out[m * REPS:(m + 1) * REPS].tolist())
        rows[name] = {"cycles": median, "ns": median / cycles_per_ns}
    for pointer in buffers.values():
        check(driver.cuMemFree(pointer))
    check(driver.cuMemFreeHost(host))
    return {"sm_mhz": cycles_per_ns * 1e3, "reps": REPS, "measures": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="hop_costs_bench.json")
    args = parser.parse_args()
    result = run()
    print(f"SM clock {result['sm_mhz']:.0f} MHz (clock64 against %globaltimer); medians of {REPS}")
    print(f"{'measure':<24} {'cycles':>8} {'ns':>8}")
    for name, row in result["measures"].items():
        print(f"{name:<24} {row['cycles']:>8.0f} {row['ns']:>8.0f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

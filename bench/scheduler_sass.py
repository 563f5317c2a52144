"""One phase of the scheduler's iteration as sm_90 machine code, compiled alone, no GPU needed: its memory operations
and branches in order, to see which loads go out together and which wait behind a branch or a store.

    PYTHONPATH=src python -m bench.scheduler_sass consume.consume [--all]

The phase, ``MODULE.FUNCTION`` of ``blink.device`` taking ``(s, sh)`` or ``(s, sh, n)`` as the iteration calls it
(``n``: a kernel argument here), runs in a kernel of its own on the arrays of the address table (``array_table.py``)
with the iteration's shared scratch (``scheduler.scratch``); numba compiles it to PTX, nvJitLink links it for sm_90
and Triton's ``cuobjdump`` prints the SASS. Shown: global and shared loads and stores, atomics, barriers, branches and
calls (``--all``: every instruction). A load marked ``table`` reads a word of the address table, which the scheduler
kernels keep in shared memory: it costs about what a shared load does, where every other global load is an L2 round
trip (or more: a ring word in host memory crosses PCIe). A load that follows a branch on a loaded word waits for that
word's round trip, as does everything after a store of a loaded word (the warp issues in order): how ``consume``'s
chain was found (``docs/scheduler.md``, "What an iteration waits for").
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"      # numba compiles for the GPU (before anything imports numba)

SHOWN = re.compile(r"\b(LDG?|STG?|LDS|STS|ATOMS?|ATOMG|RED|BAR|BRA|CALL|EXIT|RET)\b")
TABLE_PARAM = "c[0x0][0x210]"                  # the kernel's first parameter: the address table
DEST = re.compile(r"^\s*(?:@!?U?P\w+\s+)?[A-Z][\w.]*\s+(R\d+)")
# The profile's clock64() (``numba_compat.clock``), which the scheduler image takes from shim.cu, after the PTX
# header of the phase's own module.
CLOCK_PTX = """
.visible .func (.param .b32 func_retval0) blink_clock(.param .b64 blink_clock_param_0)
{
    .reg .b64 %rd<3>;
    ld.param.u64 %rd1, [blink_clock_param_0];
    mov.u64 %rd2, %clock64;
    st.u64 [%rd1], %rd2;
    st.param.b32 [func_retval0], 0;
    ret;
}
"""


def phase_cubin(name: str, arch: str = "sm_90") -> bytes:
    """The cubin of a kernel that runs ``blink.device.<name>`` once on the address table's arrays."""
    import cuda.bindings.nvjitlink as nvjitlink
    from numba import int32, int64, types

    from blink.device import array_table
    from blink.device.image import _compile_for, compute_capability, link_cubin
    from blink.device.numba_compat import cuda
    from blink.device.scheduler import scratch

    module, function = name.rsplit(".", 1)
    phase = getattr(importlib.import_module(f"blink.device.{module}"), function)
    takes_n = len(inspect.signature(phase.py_func).parameters) == 3
    arrays = array_table.register()

    def kernel(table, n):
        if takes_n:
            phase(arrays(table), scratch(), n)
        else:
            phase(arrays(table), scratch())

    cc = compute_capability(arch)
    with _compile_for(cc):
        ptx, _ = cuda.compile(kernel, (types.CPointer(int64), int32), device=False, output="ptx", cc=cc,
                              abi="numba")
    header = "".join(line + "\n" for line in ptx.splitlines()
                     if line.startswith((".version", ".target", ".address_size")))
    return link_cubin([f"-arch={arch}"], [(nvjitlink.InputType.PTX, ptx.encode(), name),
                                          (nvjitlink.InputType.PTX, (header + CLOCK_PTX).encode(), "clock")])[0]


def cuobjdump() -> str:
    """Triton's bundled ``cuobjdump`` (torch brings Triton), else one on ``PATH``."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    found = bundled if bundled.exists() else shutil.which("cuobjdump")
    if found is None:
        raise SystemExit("no cuobjdump: install torch (its Triton bundles one) or the CUDA toolkit")
    return str(found)


def sass(cubin: bytes) -> list[str]:
    """The instructions of ``cubin``, one a line, without addresses' encodings."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"\s*/\* 0x[0-9a-f]+ \*/", "", line).rstrip(" ;")
            for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def annotated(lines: list[str], everything: bool) -> list[str]:
    """``lines`` with loads of address-table words marked ``table``; only memory operations and branches unless
    ``everything``. The table's registers are those the parameter was last loaded into."""
    table, shown = set(), []
    for line in lines:
        dest = DEST.match(re.sub(r"^\s*/\*[0-9a-f]+\*/", "", line))
        base = re.search(r"\[(R\d+)\.64", line)
        mark = "   table" if re.search(r"\bLDG?\.", line) and base and base.group(1) in table else ""
        if dest:                                # a register written holds the table only if it was loaded with it
            (table.add if TABLE_PARAM in line else table.discard)(dest.group(1))
        if everything or SHOWN.search(line):
            shown.append(line + mark)
    return shown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", help="MODULE.FUNCTION of blink.device, e.g. consume.consume, batcher.plan")
    parser.add_argument("--all", action="store_true", help="every instruction, not only memory and branches")
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    for line in annotated(sass(phase_cubin(args.phase, args.arch)), args.all):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

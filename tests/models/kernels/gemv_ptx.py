"""Compile the one-row GEMV (``blink.models.kernels.gemv``) for sm_90 without a GPU, as ``gemv`` launches it, and
print, as JSON, for each ``N,K`` argument: the order of its ``griddepcontrol`` and ``cp.async`` instructions in the
PTX, its shared memory and its stack frame. Run in a process of its own (Triton's interpreter must be off when the
kernel is decorated)."""
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from blink.models.kernels import gemv  # noqa: E402

ARGS = ("w_ptr", "x_ptr", "y_ptr")
rows = []
for arg in sys.argv[1:]:
    n, k = (int(v) for v in arg.split(","))
    constexprs = dict(K=k, BLOCK_N=gemv.block_n_for(n), BLOCK_K=gemv.BLOCK_K, STAGES=gemv.STAGES,
                      COPY_BEFORE_WAIT=True, TRIGGER=True, num_warps=gemv.NUM_WARPS)
    source = GluonASTSource(fn=gemv._gemv_kernel, signature={**{a: "*bf16" for a in ARGS},
                                                             **{c: "constexpr" for c in constexprs}},
                            constexprs=constexprs, attrs={(i,): [["tt.divisibility", 16]] for i in range(len(ARGS))})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": gemv.NUM_WARPS})
    ptx = kernel.asm["ptx"]
    order = re.findall(r"^\s*(griddepcontrol\.\w+|cp\.async\.cg)", ptx, re.M)
    rows.append(dict(n=n, k=k, order=order, shared_bytes=kernel.metadata.shared,
                     local_bytes=sum(int(b) for b in re.findall(r"\.local \.align \d+ \.b8 \w+\[(\d+)\]", ptx))))
print(json.dumps(rows))

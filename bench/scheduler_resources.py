"""The scheduler image's register, stack and spill use, from the linker, on any machine (no GPU needed).

``python -m bench.scheduler_resources [--policy fcfs] [--json PATH]`` links the image with ``blink.device.image.link``
(policy + iteration from numba, shim from NVRTC, libcudadevrt) and nvJitLink's ``-verbose``, and prints, per
function, what ptxas reported: registers, stack frame, spill stores and loads, shared memory. The iteration is
inlined into the two scheduler kernels; were ``iterate`` a function of its own again, it would show as one.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from bench import tree_commit

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"      # numba compiles for the GPU (before anything imports numba)

FRAME = re.compile(r"Function properties for '?(\w+)'?:?\s*\n\S+\s+\.\s+(\d+) bytes stack frame, (\d+) bytes spill "
                   r"stores, (\d+) bytes spill loads")
USED = re.compile(r"Function properties for '(\w+)':\s*\ninfo\s+: used (\d+) registers, .*?(\d+) stack, "
                  r"(\d+) bytes smem")


def linker_log(policy_name: str, arch: str = "sm_90") -> str:
    from blink.device import image, policy

    return image.link(getattr(policy, policy_name), arch, ("-verbose",))[1]


def resources(log: str) -> dict[str, dict]:
    """Function -> what ptxas and the linker said of it (only the scheduler's own functions; the iteration, where
    ptxas keeps it a function of its own, under numba's mangled name of ``make_iterate``'s ``iterate``, as
    ``iterate``)."""
    found: dict[str, dict] = {}
    for name, stack, stores, loads in FRAME.findall(log):
        found.setdefault(_short(name), {}).update(stack_bytes=int(stack), spill_store_bytes=int(stores),
                                                  spill_load_bytes=int(loads))
    for name, registers, stack, smem in USED.findall(log):
        found.setdefault(_short(name), {}).update(registers=int(registers), stack_bytes=int(stack),
                                                  smem_bytes=int(smem))
    return {name: values for name, values in found.items() if name.startswith("blink_") or name == "iterate"}


def _short(name: str) -> str:
    return "iterate" if "make_iterate" in name else name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="fcfs", help="a policy of blink.device.policy")
    parser.add_argument("--json", default=None, help="write the table here")
    parser.add_argument("--commit", default=None, help="the measured tree's commit (default: $BLINK_COMMIT, else HEAD)")
    args = parser.parse_args()
    table = resources(linker_log(args.policy))
    print(f"{'function':<24} {'registers':>9} {'stack B':>8} {'spill st B':>10} {'spill ld B':>10} {'smem B':>7}")
    for name, r in sorted(table.items()):
        cells = [r.get(k, "-") for k in ("registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes",
                                          "smem_bytes")]
        print(f"{name:<24} {cells[0]:>9} {cells[1]:>8} {cells[2]:>10} {cells[3]:>10} {cells[4]:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": tree_commit(args.commit), "policy": args.policy, "functions": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

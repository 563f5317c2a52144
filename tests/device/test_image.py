"""The real scheduler image: it links for sm_90 on a machine without a GPU (CI) with no register spilled, its
per-request and per-row copies read before they store, it is refused under the simulator, and the image of a
built-in policy is cached.

Everything numba-related runs in subprocesses here, so this module also loads under the simulator. The two links
(a user's policy, a built-in one) take most of a minute each on a CI box: they start together, and each test waits
for its own, as long as its link progresses (the limit is on the CPU time each uses, not on the wall clock: on a
loaded 2-core host a link that waited for a core outlasted a 600 s wall-clock limit).
"""
import json
from pathlib import Path

import pytest

from tests.device.fresh_python import finish, run_python, start_python

ROOT = Path(__file__).resolve().parents[2]

USER_POLICY_LINK = """
    import json, sys
    sys.path.insert(0, {root!r})
    from bench.scheduler_resources import resources
    from blink.device.config import IMAGE_ARCH
    from blink.device.image import link
    from blink.device.numba_compat import cuda
    from numba import int64

    @cuda.jit(device=True)
    def shortest_prompt_first(arrival_ns, prompt_len, max_tokens, priority, request_id):
        return int64(prompt_len)

    image, log = link(shortest_prompt_first, IMAGE_ARCH, ("-verbose",))
    open({out!r}, "wb").write(image)
    print(json.dumps(resources(log)))
"""
CACHED_LINK = """
    import os, time
    os.environ["BLINK_CACHE_DIR"] = {cache!r}
    from blink.device.image import link_image
    t = time.monotonic(); first = link_image(); linked = time.monotonic() - t
    t = time.monotonic(); second = link_image(); cached = time.monotonic() - t
    print(first == second, len(os.listdir(os.path.join({cache!r}, "scheduler"))), linked > 10 * cached)
"""


@pytest.fixture(scope="module")
def links(tmp_path_factory):
    """Both link processes, started at once: ``(process, its output path)`` by name."""
    out, cache = tmp_path_factory.mktemp("image") / "image.cubin", tmp_path_factory.mktemp("cache")
    started = {"user": (start_python(USER_POLICY_LINK.format(root=str(ROOT), out=str(out)), simulator=False), out),
               "cached": (start_python(CACHED_LINK.format(cache=str(cache)), simulator=False), cache)}
    yield started
    for process, _ in started.values():
        process.kill()


def test_the_scheduler_image_links_for_sm90_without_a_gpu_and_spills_no_register(links):
    """What ptxas reported of each kernel: no spill (the iteration read ~80 arrays' addresses and shapes once and
    spilled them, 1 KiB per thread; ``array_table.py`` reads each where it is used)."""
    process, out = links["user"]
    functions = json.loads(finish(process))
    image = out.read_bytes()
    assert image[:4] == b"\x7fELF"
    kernels = ("blink_scheduler_tail", "blink_scheduler_window", "blink_done", "blink_standin_step")
    for kernel in kernels:
        assert kernel.encode() in image, kernel
    assert set(kernels) <= set(functions)
    for name, used in functions.items():
        assert used["spill_store_bytes"] == used["spill_load_bytes"] == 0, (name, used)


# For each device function, the PTX numba emits for it alone: the loads of values (not of the address table) issued
# before its first store, and its stores.
LOAD_ORDER = r"""
    import json, re
    from numba import int32, int64, types
    from blink.device import array_table, image, publish, sampling, waiting
    from blink.device.numba_compat import cuda

    arrays = array_table.register()

    def loads_then_stores(body):
        def entry(table, slot):
            body(arrays(table), slot)
            return 0
        with image._compile_for((9, 0)):
            ptx, _ = cuda.compile(entry, int32(types.CPointer(int64), int32), device=True, abi="c", output="ptx",
                                  cc=(9, 0), abi_info={"abi_name": "probe"})
        code = ptx[ptx.index("probe("):]
        table = re.search(r"ld\.param\.u64\s+(%rd\d+), \[probe_param_0\]", code).group(1)
        before, stores = 0, 0
        for line in code.splitlines():
            op = (line.split() or [""])[0]
            if op.startswith("ld.") and not op.startswith("ld.param") and f"[{table}" not in line:
                before += 0 if stores else 1
            elif op.startswith("st.") and not op.startswith(("st.param", "st.local")):
                stores += 1
        return before, stores

    @cuda.jit(device=True)
    def load_header(s, slot):
        waiting.load_header(s, slot)

    @cuda.jit(device=True)
    def write_sampling(s, slot):
        sampling.write_sampling(s, slot, slot, True)

    @cuda.jit(device=True)
    def publish_stats(s, slot):
        publish.publish_stats(s)

    print(json.dumps({f.__name__: loads_then_stores(f) for f in (load_header, write_sampling, publish_stats)}))
"""


def test_copies_read_what_they_store_before_their_first_store():
    """numba's arrays are pointers the compiler cannot tell apart, so a load after a store waits for it: a copy that
    loads and stores in turn costs a memory round trip per field (across PCIe for a request's header). Each of these
    issues most of its loads before its first store (before ``bf78c2b``/``1d2568b``/``a5e0822``: 0, 1 and 1 of 28,
    11 and 34)."""
    counts = json.loads(run_python(LOAD_ORDER, simulator=False).splitlines()[-1])
    for name, (loads_first, stores) in counts.items():
        assert stores > 0 and 2 * loads_first >= stores, (name, loads_first, stores)


def test_compiling_the_gpu_image_under_the_simulator_is_refused():
    from blink.device.image import compile_policy
    from blink.errors import LaunchError

    with pytest.raises(LaunchError, match="NUMBA_ENABLE_CUDASIM"):
        compile_policy()


def test_the_image_of_a_builtin_policy_is_linked_once_then_read_from_the_cache(links):
    process, _ = links["cached"]
    assert finish(process).split() == ["True", "1", "True"]

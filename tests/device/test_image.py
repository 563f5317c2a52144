"""The real scheduler image: it links for sm_90 on a machine without a GPU (CI), is refused under the simulator, and
the image of a built-in policy is cached.

Everything numba-related runs in subprocesses here, so this module also loads under the simulator. The two links
(a user's policy, a built-in one) take most of a minute each on a CI box: they start together, and each test waits
for its own, as long as its link progresses (the limit is on the CPU time each uses, not on the wall clock: on a
loaded 2-core host a link that waited for a core outlasted a 600 s wall-clock limit).
"""
import pytest

from tests.device.fresh_python import finish, start_python

USER_POLICY_LINK = """
    from blink.device.image import link_image
    from blink.device.numba_compat import cuda
    from numba import int64

    @cuda.jit(device=True)
    def shortest_prompt_first(arrival_ns, prompt_len, max_tokens, priority, request_id):
        return int64(prompt_len)

    open({out!r}, "wb").write(link_image(shortest_prompt_first))
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
    started = {"user": (start_python(USER_POLICY_LINK.format(out=str(out)), simulator=False), out),
               "cached": (start_python(CACHED_LINK.format(cache=str(cache)), simulator=False), cache)}
    yield started
    for process, _ in started.values():
        process.kill()


def test_the_scheduler_image_links_for_sm90_without_a_gpu(links):
    process, out = links["user"]
    finish(process)
    image = out.read_bytes()
    assert image[:4] == b"\x7fELF"
    for kernel in (b"blink_scheduler_tail", b"blink_scheduler_window", b"blink_done", b"blink_standin_step"):
        assert kernel in image, kernel


def test_compiling_the_gpu_image_under_the_simulator_is_refused():
    from blink.device.image import compile_policy
    from blink.errors import LaunchError

    with pytest.raises(LaunchError, match="NUMBA_ENABLE_CUDASIM"):
        compile_policy()


def test_the_image_of_a_builtin_policy_is_linked_once_then_read_from_the_cache(links):
    process, _ = links["cached"]
    assert finish(process).split() == ["True", "1", "True"]

"""The real scheduler image: it links for sm_90 on a machine without a GPU (CI), is refused under the simulator, and
the image of a built-in policy is cached.

Everything numba-related runs in subprocesses here, so this module also loads under the simulator.
"""
import pytest

from tests.device.fresh_python import run_python


def test_the_scheduler_image_links_for_sm90_without_a_gpu(tmp_path):
    out = tmp_path / "image.cubin"
    run_python(f"""
        from blink.device.image import link_image
        from blink.device.numba_compat import cuda
        from numba import int64

        @cuda.jit(device=True)
        def shortest_prompt_first(arrival_ns, prompt_len, max_tokens, priority, request_id):
            return int64(prompt_len)

        open({str(out)!r}, "wb").write(link_image(shortest_prompt_first))
    """, simulator=False)
    image = out.read_bytes()
    assert image[:4] == b"\x7fELF"
    for kernel in (b"blink_scheduler_tail", b"blink_scheduler_window", b"blink_done", b"blink_standin_step"):
        assert kernel in image, kernel


def test_compiling_the_gpu_image_under_the_simulator_is_refused():
    from blink.device.image import compile_policy
    from blink.errors import LaunchError

    with pytest.raises(LaunchError, match="NUMBA_ENABLE_CUDASIM"):
        compile_policy()


def test_the_image_of_a_builtin_policy_is_linked_once_then_read_from_the_cache(tmp_path):
    out = run_python(f"""
        import os, time
        os.environ["BLINK_CACHE_DIR"] = {str(tmp_path)!r}
        from blink.device.image import link_image
        t = time.monotonic(); first = link_image(); linked = time.monotonic() - t
        t = time.monotonic(); second = link_image(); cached = time.monotonic() - t
        print(first == second, len(os.listdir({str(tmp_path / "scheduler")!r})), linked > 10 * cached)
    """, simulator=False)
    assert out.split() == ["True", "1", "True"]

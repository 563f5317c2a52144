"""blink.backends: device selection against numba's simulator mode, and the KV pool's sizing rule. The backends
themselves run in tests/test_engine.py."""
import os
import subprocess
import sys
import textwrap

import pytest

from blink.backends import scheduler_config, select_device
from blink.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from blink.errors import EngineError
from blink.models.memory import kv_page_bytes

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def test_the_cpu_engine_refuses_a_process_that_imported_numba_without_the_simulator():
    code = textwrap.dedent("""
        import numba
        from blink.backends import select_device
        from blink.errors import EngineError
        try:
            select_device("cpu")
        except EngineError as e:
            print(e)
    """)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONPATH": os.path.abspath(SRC)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "the cpu engine needs numba's CUDA simulator on, but this process already imported numba with it off" \
        in out.stdout, out.stderr
    assert "NUMBA_ENABLE_CUDASIM=1" in out.stdout


def test_device_selection_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert select_device("auto") == select_device("cpu") == "cpu"
    with pytest.raises(EngineError, match="torch sees no CUDA GPU: use device='cpu'"):
        select_device("cuda")


def test_the_pool_must_hold_one_longest_sequence():
    from blink.models import ModelConfig, build_model

    model = build_model(ModelConfig("LlamaForCausalLM", vocab_size=16, hidden_size=8, intermediate_size=8,
                                    num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5,
                                    rope_theta=1e4, rotary_dim=4, max_position_embeddings=64), dtype="float16")
    assert kv_page_bytes(model, 16) == 3 * 2 * 16 * 1 * 4 * 2
    config = EngineConfig(scheduler=SchedulerConfig(page_size=16, max_num_seqs=4, max_num_batched_tokens=32))
    assert scheduler_config(config, 64, 4, (2,), "budget").num_pages == 4
    with pytest.raises(ValueError, match=r"holds 3 pages of 16 tokens, but one sequence of max_model_len=64 "
                                         r"tokens needs 4: give it more memory \(the knob\)"):
        scheduler_config(config, 64, 3, (2,), "the knob")


def test_a_gpu_the_scheduler_image_is_not_built_for_is_refused_by_name():
    """The image is an sm_90 cubin: a GPU of another major version would refuse it at cuModuleLoadData, after the
    model has loaded; it is refused before, naming the GPU and what to do."""
    from blink.backends import check_capability

    check_capability("NVIDIA H200", (9, 0))
    for name, capability in (("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA L40S", (8, 9)), ("NVIDIA B200", (10, 0))):
        major, minor = capability
        with pytest.raises(EngineError, match=rf"compute capability 9\.0 .* {name} is {major}\.{minor}"):
            check_capability(name, capability)


def test_an_fp8_kv_cache_takes_one_byte_an_element():
    """``kv_cache_dtype="fp8"``: a page's K and V at one byte each, so twice the pages of a bf16 pool in the same
    memory (the token ids beside them unchanged)."""
    from blink.backends import pool_kv_dtype, pool_page_bytes
    from blink.models import ModelConfig, build_model
    from blink.models.e4m3 import FP8
    from blink.models.history import TOKEN_BYTES

    model = build_model(ModelConfig("LlamaForCausalLM", vocab_size=16, hidden_size=8, intermediate_size=8,
                                    num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5,
                                    rope_theta=1e4, rotary_dim=4, max_position_embeddings=64), dtype="bfloat16")
    assert pool_kv_dtype(EngineConfig(kv_cache_dtype="fp8"), model) == FP8
    assert pool_kv_dtype(EngineConfig(), model) == model.dtype
    elements = 3 * 2 * 16 * 1 * 4  # layers x (K, V) x page size x KV heads x head dim
    assert pool_page_bytes(model, 16, FP8) == elements + 16 * TOKEN_BYTES
    assert kv_page_bytes(model, 16) == kv_page_bytes(model, 16, FP8) * 2 == elements * 2


def test_the_step_layout_gives_a_decoding_sequence_its_drafts_rows():
    """``StepLayout.decode_query_len`` (attention's query blocks) is a token plus the drafts the engine verifies, and
    the same layout crosses to a tensor-parallel follower (``ranks.Setup``)."""
    from dataclasses import astuple

    from blink.backends import step_layout
    from blink.ranks import Setup
    from blink.ring.geometry import RingGeometry

    plain = SchedulerConfig(page_size=16, max_num_seqs=4, max_num_batched_tokens=32)
    speculating = SchedulerConfig(page_size=16, max_num_seqs=4, max_num_batched_tokens=32,
                                  speculative=SpeculativeConfig(num_speculative_tokens=3))
    assert step_layout(plain, 64, RingGeometry()).decode_query_len == 1
    layout = step_layout(speculating, 64, RingGeometry())
    assert (layout.decode_query_len, layout.max_pages_per_seq, layout.max_num_seqs) == (4, 4, 4)
    assert Setup(10, 16, *astuple(layout)).layout() == layout

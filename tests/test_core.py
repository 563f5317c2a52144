"""blink.core: the ring an engine creates, and the placement of its request side. (The engine serves end to end in
tests/test_engine.py; with its request side in GPU memory, on the H200: tests/nic/remote/test_attach_cli.py.)"""
import pytest

from blink.config import EngineConfig, SchedulerConfig
from blink.core import EngineCore, create_ring
from blink.errors import EngineError, RingMismatch
from blink.nic.agent import Agent
from blink.ring import control
from blink.ring.geometry import RingGeometry
from blink.ring.request import SamplingParams

GEOMETRY = RingGeometry(n_slots=4, max_prompt_tokens=8, max_output_tokens=8)


def test_a_ring_whose_request_side_the_engine_keeps_in_gpu_memory_refuses_agents_that_open_it_by_name():
    with create_ring(None, GEOMETRY) as host:
        assert control.read(host)["engine_state"] == control.ENGINE_STARTING
        Agent.attach(host)
    with create_ring(None, GEOMETRY, "device") as stale:
        assert control.read(stale)["engine_state"] == control.ENGINE_ELSEWHERE
        with pytest.raises(RingMismatch, match="not the one its engine serves.*blink agent --remote HOST:PORT"):
            Agent.attach(stale)


def test_the_cpu_engine_refuses_a_request_side_in_gpu_memory_before_it_loads_anything():
    with pytest.raises(EngineError, match="request_side='device'.*needs a GPU.*on the CPU use request_side='host'"):
        EngineCore(EngineConfig(device="cpu", request_side="device", model="/nonexistent"))


@pytest.mark.gpu
def test_an_engine_serving_its_request_side_from_gpu_memory_generates_what_the_host_ring_does(tmp_path):
    """The in-process agent reaches the GPU copy through ``ring_memory``; the shared copy stays marked and untouched."""
    from blink.bench.shapes import write_model_dir
    from blink.engine import Engine

    model = str(write_model_dir(tmp_path / "tiny", "tiny-qwen3"))
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, num_pages=256, max_model_len=64)
    prompts = [[5, 17, 99], list(range(1, 40)), [7] * 12]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outputs = {}
    for side in ("host", "device"):
        config = EngineConfig(model=model, load_format="dummy", device="cuda", request_side=side, n_slots=8,
                              scheduler=scheduler)
        with Engine(config) as engine:
            outputs[side] = [out.token_ids for out in engine.generate(prompts, params)]
            stats, host_copy = engine.core.stats(), control.read(engine.core.memory)
        assert stats["finished"] == len(prompts) and stats["launch_error"] == 0
        assert stats["engine_state"] == control.ENGINE_SERVING
        if side == "device":
            assert host_copy["engine_state"] == control.ENGINE_ELSEWHERE and host_copy["finished"] == 0
    assert outputs["device"] == outputs["host"] and all(len(tokens) == 20 for tokens in outputs["host"])

"""The scheduler loop on the H200: it serves the ring by device graph launch with the same outputs as the simulator,
and a loop that dies is reported, not hung.

GPU tests need ``NUMBA_ENABLE_CUDASIM=0`` (bench/gpu_suite.sh sets it); everything numba-related runs in
subprocesses here, so this module also loads under the simulator.
"""
import json
import multiprocessing as mp
import resource
import time
import uuid

import numpy as np
import pytest

from blink.device.config import MAX_BLOCK_THREADS, SchedulerConfig
from blink.ring.geometry import RingGeometry
from blink.ring.layout import RingLayout
from blink.ring.request import SamplingParams
from tests.device.fresh_python import run_python

# -- on the H200 -------------------------------------------------------------------------------------------------

GPU_GEOMETRY = RingGeometry(n_slots=4096, max_prompt_tokens=64, max_output_tokens=32, max_stop_ids=1,
                            prefix_page_size=16)
GPU_CONFIG = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, page_size=16, num_pages=8192,
                             max_model_len=96, eos_token_ids=(3,))


def make_requests(n: int, seed: int = 7) -> list[tuple[list[int], dict]]:
    """Half the prompts start with one of four 48-token prefixes (the prefix cache's hits), cut anywhere."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, 32000, (4, 48)).tolist()
    requests = []
    for i in range(n):
        prompt = rng.integers(0, 32000, int(rng.integers(1, 65))).tolist()
        if i % 2:
            prompt = (prefixes[i % 4][:int(rng.integers(0, 49))] + prompt)[:64]
        params = dict(max_tokens=int(rng.integers(1, 33)), seed=int(rng.integers(0, 2**63)),
                      ignore_eos=bool(i % 3 == 0), stop_token_ids=(int(rng.integers(0, 32000)),))
        requests.append((prompt, params))
    return requests


def agent_process(name: str, geometry: RingGeometry, requests, result_path: str, device_side=None) -> None:
    """Submit every request as slots allow, collect outputs, write them as JSON, then ask the loop to stop.

    ``device_side``: ``(ipc_handle, size, pci_bus_id)`` when the ring's request side is in the engine's GPU memory:
    this process then writes it through CUDA IPC, as a NIC would (payload first, state word last), and reads the
    output side from the shared memory."""
    from blink.errors import RingFull
    from blink.nic.agent import Agent
    from blink.ring.split import SplitMemory, Window
    from blink.ring.transport import SharedMemory

    with SharedMemory.open(name) as shared:
        memory = shared
        if device_side is not None:
            from blink.nic.remote.ipc import CudaIpcMemory

            handle, split, bus_id = device_side
            memory = SplitMemory([(0, CudaIpcMemory(handle, split, bus_id)),
                                  (split, Window(shared, split, shared.size - split))])
        agent = Agent(memory, geometry, liveness_timeout_s=60)
        outputs, pending, ids = {}, list(enumerate(requests)), {}
        start = time.monotonic()
        while pending or agent.in_flight:
            while pending:
                index, (prompt, params) = pending[0]
                try:
                    ids[agent.submit(prompt, SamplingParams(**params))] = index
                except RingFull:
                    break
                pending.pop(0)
            for out in agent.poll():
                tokens, _ = outputs.get(ids[out.request_id], ([], None))
                outputs[ids[out.request_id]] = (tokens + out.new_tokens, out.finish_reason)
        elapsed = time.monotonic() - start
        stats = agent.stats()
        agent.request_shutdown()
        if memory is not shared:
            memory.segments[0][1].close()
    with open(result_path, "w") as f:
        json.dump({"outputs": outputs, "seconds": elapsed, "stats": stats}, f)


def simulate(requests, geometry, config) -> dict:
    """Outputs of the same requests through the simulator backend, in a subprocess (the simulator is per process)."""
    code = f"""
        import json, sys
        from blink.device.config import MAX_BLOCK_THREADS, SchedulerConfig
        from blink.ring.request import SamplingParams
        from blink.ring.geometry import RingGeometry
        from blink.ring.layout import RingLayout
        from blink.device.sim import SimScheduler
        from blink.device.step import StepBuffers, StepLayout
        from blink.nic.agent import Agent
        from blink.ring.transport import LocalMemory
        geometry = RingGeometry(**{geometry.__dict__!r})
        config = SchedulerConfig(**{ {**config.__dict__, "block_threads": 4}!r})
        requests = json.loads({json.dumps(requests)!r})
        layout = RingLayout(geometry)
        memory = LocalMemory(layout.size)
        memory.write(0, layout.control_bytes())
        agent = Agent(memory, geometry)
        step = StepBuffers(StepLayout(config.buckets[-1], config.max_num_seqs, config.max_pages_per_seq))
        sim = SimScheduler(layout.view(memory.buffer), geometry, config, step, threads=4)
        ids = {{agent.submit(p, SamplingParams(**{{**k, "stop_token_ids": tuple(k["stop_token_ids"])}})): i
               for i, (p, k) in enumerate(requests)}}
        outputs = {{}}
        while agent.in_flight:
            sim.iteration()
            for out in agent.poll():
                tokens, _ = outputs.get(ids[out.request_id], ([], None))
                outputs[ids[out.request_id]] = (tokens + out.new_tokens, out.finish_reason)
        print(json.dumps(outputs))
    """
    return {int(k): tuple(v) for k, v in json.loads(run_python(code, simulator=True).splitlines()[-1]).items()}


def serve_on_gpu(mode: str, caching: bool, requests, request_side: str = "host") -> tuple[dict, dict]:
    """GpuScheduler (stand-in step) in this process, the agent in another; returns outputs and measurements."""
    import torch
    from cuda.bindings import driver

    from blink.device.driver import check
    from blink.device.runtime import GpuScheduler
    from blink.device.step import StepBuffers, StepLayout
    from blink.ring.transport import SharedMemory

    config = SchedulerConfig(**{**GPU_CONFIG.__dict__, "launch_mode": mode, "enable_prefix_caching": caching})
    geometry = RingGeometry(**{**GPU_GEOMETRY.__dict__, "prefix_page_size": GPU_GEOMETRY.prefix_page_size * caching})
    layout = RingLayout(geometry)
    name = f"blink-gpu-test-{uuid.uuid4().hex[:8]}"
    step = StepBuffers(StepLayout(config.buckets[-1], config.max_num_seqs, config.max_pages_per_seq), "cuda")
    torch.cuda.synchronize()
    result_path = f"/tmp/{name}.json"
    with SharedMemory.create(name, layout.size) as memory:
        memory.write(0, layout.control_bytes())
        scheduler = GpuScheduler(memory, geometry, config, step.layout,
                                 {k: t.data_ptr() for k, t in step.tensors().items()}, request_side=request_side)
        device_side = None
        if request_side == "device":
            bus_id = check(driver.cuDeviceGetPCIBusId(16, check(driver.cuDeviceGet(0)))).decode().rstrip("\0")
            device_side = (scheduler.ipc_handle, scheduler.request_bytes, bus_id)
        agent = mp.get_context("spawn").Process(target=agent_process,
                                                args=(name, geometry, requests, result_path, device_side))
        scheduler.start()
        agent.start()
        before, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        scheduler.join(timeout_s=300)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - wall
        profile = scheduler.profile()
        agent.join(60)
        scheduler.close()
    with open(result_path) as f:
        result = json.load(f)
    outputs = {int(k): tuple(v) for k, v in result["outputs"].items()}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return outputs, {"mode": mode, "caching": caching, "request_side": request_side, "wall_s": wall,
                     "host_cpu_s": cpu, "agent_s": result["seconds"], "stats": result["stats"], "profile_us": profile}


@pytest.mark.gpu
@pytest.mark.parametrize("mode,caching", [("fire_and_forget", True), ("tail", True), ("fire_and_forget", False)])
def test_gpu_loop_serves_ten_thousand_requests_like_the_simulator(mode, caching):
    from blink.ring.reference import expected_output

    requests = make_requests(10_000)
    outputs, measured = serve_on_gpu(mode, caching, requests)
    print(f"\n[gpu loop {mode}] {json.dumps(measured)}")
    assert len(outputs) == len(requests)
    for i, (prompt, params) in enumerate(requests):
        tokens, reason = expected_output(prompt, SamplingParams(**params), GPU_CONFIG.eos_token_ids)
        assert outputs[i] == (tokens, reason), i
    subset = requests[:150]
    simulated = simulate(subset, GPU_GEOMETRY, GPU_CONFIG)
    assert {i: outputs[i] for i in range(len(subset))} == simulated
    assert measured["stats"]["finished"] == 10_000 and measured["stats"]["launch_error"] == 0
    assert (measured["stats"]["prefix_hit_tokens"] > 0) == caching
    # The host only sleeps in join(): far below one core even while 10k requests stream through.
    assert measured["host_cpu_s"] < 0.1 * measured["wall_s"] + 0.5


@pytest.mark.gpu
def test_a_foreign_writer_serves_ten_thousand_requests_through_a_ring_in_gpu_memory():
    """The request side in HBM, written by another process through CUDA IPC (a NIC's role): every output is the
    reference consumer's, and the scheduler's phases are reported beside the host-memory ring's."""
    from blink.ring.reference import expected_output

    requests = make_requests(10_000, seed=11)
    outputs, measured = serve_on_gpu("fire_and_forget", True, requests, request_side="device")
    _, host = serve_on_gpu("fire_and_forget", True, requests[:2000], request_side="host")
    print(f"\n[gpu ring in HBM] {json.dumps(measured)}\n[gpu ring in host memory] {json.dumps(host)}")
    assert len(outputs) == len(requests)
    for i, (prompt, params) in enumerate(requests):
        assert outputs[i] == expected_output(prompt, SamplingParams(**params), GPU_CONFIG.eos_token_ids), i
    assert measured["stats"]["finished"] == 10_000 and measured["stats"]["launch_error"] == 0


def bad_step_graph_process(outcome) -> None:
    """Runs a loop whose step "graph" was never instantiated for device launch (a host-only instantiation) and puts
    what join() and the agent reported on ``outcome``. A process of its own: the device runtime faults on the handle
    (seen on the H200: CUDA_ERROR_ILLEGAL_ADDRESS, not a clean cudaGraphLaunch error code), and that error is sticky:
    every later CUDA call of the process fails."""
    import torch
    from cuda.bindings import driver, runtime

    from blink.device import graphs
    from blink.device.driver import check
    from blink.device.image import MAX_BUCKETS
    from blink.device.runtime import GpuScheduler
    from blink.device.step import StepBuffers, StepLayout
    from blink.errors import EngineUnresponsive, LaunchError
    from blink.nic.agent import Agent
    from blink.ring.transport import LocalMemory

    geometry = RingGeometry(n_slots=64, max_prompt_tokens=8, max_output_tokens=8, prefix_page_size=16)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, page_size=16, num_pages=64, max_model_len=16,
                             buckets=(1, 2, 4, 8, 16))
    layout = RingLayout(geometry)
    step = StepBuffers(StepLayout(16, 8, 1), "cuda")
    torch.cuda.synchronize()
    with LocalMemory(layout.size) as memory:
        memory.write(0, layout.control_bytes())
        scheduler = GpuScheduler(memory, geometry, config, step.layout,
                                 {k: t.data_ptr() for k, t in step.tensors().items()})
        host_only = check(runtime.cudaGraphInstantiate(runtime.cudaGraph_t(init_value=int(
            graphs.captured(scheduler.stream, lambda: None))), 0))
        words = np.full(2 * MAX_BUCKETS, int(host_only), np.uint64)
        check(driver.cuMemcpyHtoD(scheduler.launch[0], words, words.nbytes))
        agent = Agent(memory, geometry, liveness_timeout_s=2)
        scheduler.start()
        agent.submit([1, 2], SamplingParams(max_tokens=2))
        try:
            scheduler.join(timeout_s=60)
            outcome.put(("join", "returned"))
        except LaunchError as e:
            outcome.put(("join", f"LaunchError: {e}"))
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline:
                agent.poll()
                time.sleep(0.05)
            outcome.put(("agent", "kept polling for 20 s"))
        except EngineUnresponsive as e:
            outcome.put(("agent", f"EngineUnresponsive: {e}"))


@pytest.mark.gpu
def test_a_loop_killed_by_a_bad_step_graph_is_reported_not_hung():
    """join() must raise, and the agent must see the engine as unresponsive, instead of waiting forever."""
    context = mp.get_context("spawn")
    outcome = context.Queue()
    process = context.Process(target=bad_step_graph_process, args=(outcome,))
    process.start()
    reports = dict(outcome.get(timeout=120) for _ in range(2))
    process.join(60)
    assert reports["join"].startswith("LaunchError"), reports
    assert reports["agent"].startswith("EngineUnresponsive"), reports


@pytest.mark.gpu
def test_a_block_the_kernels_registers_do_not_fit_is_refused_by_name():
    """The kernel's registers cap its block (65,536 per SM): a larger ``block_threads`` is refused at start, naming
    the field and the largest that fits, instead of failing the first launch with "too many resources"."""
    import torch

    from blink.device.runtime import GpuScheduler
    from blink.device.step import StepBuffers, StepLayout
    from blink.errors import LaunchError
    from blink.ring.transport import LocalMemory

    config = SchedulerConfig(**{**GPU_CONFIG.__dict__, "block_threads": MAX_BLOCK_THREADS})
    layout = RingLayout(GPU_GEOMETRY)
    step = StepBuffers(StepLayout(config.buckets[-1], config.max_num_seqs, config.max_pages_per_seq), "cuda")
    torch.cuda.synchronize()
    memory = LocalMemory(layout.size)
    memory.write(0, layout.control_bytes())
    with pytest.raises(LaunchError,
                       match=rf"block_threads={MAX_BLOCK_THREADS} is more than .* use block_threads <= \d+"):
        GpuScheduler(memory, GPU_GEOMETRY, config, step.layout, {k: t.data_ptr() for k, t in step.tensors().items()})

"""Shared pytest setup: ``@pytest.mark.gpu`` tests run only where a CUDA device is visible.

Device policy code runs under numba's CUDA simulator unless the GPU suite asks for the real device with
``NUMBA_ENABLE_CUDASIM=0`` (the simulator must be chosen before numba is first imported, so it is chosen here).
"""
import os
import shutil

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# Two test workers on CI's two cores (pytest -n 2): torch's intra-op threads (one per core by default) in both, and
# in the engines they start, spin against each other. One thread each (inherited by the processes a test starts):
# a CPU model step took 2.6x as long with two threads as with one beside another worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def _has_cuda_gpu() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return shutil.which("nvidia-smi") is not None


def pytest_collection_modifyitems(config, items):
    if _has_cuda_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run bench/gpu_suite.sh on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded default model's tokenizer (loaded once: tests only read it)."""
    from blink.models import default_model_path
    from blink.nic.text import Tokenizer
    return Tokenizer(default_model_path())


@pytest.fixture
def local_ring():
    """Factory: an initialised in-process ring, an Agent on it, and the ReferenceConsumer playing the GPU."""
    from blink.nic.agent import Agent
    from blink.ring.layout import RingLayout
    from blink.ring.reference import ReferenceConsumer
    from blink.ring.transport import LocalMemory

    memories = []

    def make(geometry, *, eos_token_ids=(), max_running=256, liveness_timeout_s=10.0):
        layout = RingLayout(geometry)
        memory = LocalMemory(layout.size)
        memory.write(0, layout.control_bytes())
        memories.append(memory)
        agent = Agent(memory, geometry, liveness_timeout_s=liveness_timeout_s)
        consumer = ReferenceConsumer(layout.view(memory.buffer), eos_token_ids=eos_token_ids,
                                     max_running=max_running)
        return memory, agent, consumer

    yield make
    for memory in memories:
        memory.close()
